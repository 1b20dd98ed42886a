"""DAGER-style span attack on text Transformers (Petrov et al. 2024, "DAGER: Exact Gradient
Inversion for Large Language Models", sec. 3-4).

A linear layer ``Y = X W^T`` fed the rows ``x_i`` of ``X`` (every real token of every sentence)
gets the gradient ``dL/dW = sum_i g_i x_i^T``, so the row space of ``dL/dW`` (out, in) lies in
``span{x_i}`` and has rank <= B*T (eq. 2-3 of the paper). When B*T < width the span is a proper
subspace and a vector x is a layer input iff its distance to the span is (numerically) zero:

    d(x) = || x - P P^T x ||_2 / ||x||_2,   P = orthonormal basis of the top singular vectors
                                               of [dW_Q; dW_K; dW_V] (rank cutoff ``rank_tol``).

Layer 1 (this file): the input of the first attention block is a known function of one token and
its position, ``h0(v, t) = N0(assemble(E_tok[v], E_pos[t]))`` (post-LN encoders: the embedding
LayerNorm of token + position + segment; pre-LN decoders: ``ln_1`` of block 0 on token +
position), so every candidate token is tested at every position in vectorised chunks:
``S_t = {v : d(h0(v, t)) < tol1}``. The candidates are the batch's bag from the token-embedding
gradient (`veil.attacks.presence`) when it is exported (~50 tokens instead of 30k), else the whole
vocabulary. The first layer alone admits every batch token at its position, but also a token at
any position linked to it through shared tokens (``h0(v, t2) ~ h0(v, t1) - h0(w, t1) + h0(w, t2)``
up to the LayerNorm scale), and does not say which sentence a token belongs to. For encoders the
embedding LayerNorm's Jacobian pins every token that occurs at one position (`pin_positions`); layer 2 (its input is the first block's
output, which mixes the whole sentence) resolves that, in `veil.attacks.span_search`:
greedy left-to-right extension for causal decoders (DAGER alg. 1; the layer-2 input at t depends
only on tokens <= t) and an assignment search for bidirectional encoders. An encoder classifier
given the batch size is searched one sentence at a time instead (`veil.attacks.span_peel`: an
exact per-sentence test from the last block's Q gradient, `veil.attacks.span_checks`, on the
[CLS] row or, mean-pooled, on every row; each found sentence's own gradient is subtracted from
the observation), which keeps working when B*T approaches the width ([CLS] pooling). The joint
assignment search is the fallback where that test has no gap.

Dropout makes the layer inputs ``mask * x / (1 - p)``: no longer in the span of clean vectors.
The exact check here then passes nothing (token recovery 0.000 is the check failing, not
protection): `veil.attacks.span_robust` (``span-robust``) replaces it with a test that searches
for the dropped coordinates, and recovers such updates.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from veil.attacks import ATTACKS
from veil.attacks.base import Attack, Knowledge, Observation, Reconstruction
from veil.attacks.presence import special_ids
from veil.errors import VeilError
from veil.models.base import VeilModel, linear_weight


# ----------------------------------------------------------------------------- spans
@dataclass
class Span:
    """Orthonormal basis (width, rank) of the row space of one layer's projection gradients."""

    basis: Tensor
    singular: Tensor
    width: int

    @property
    def rank(self) -> int:
        return self.basis.shape[1]

    def distance(self, x: Tensor) -> Tensor:
        """Relative distance of each row of ``x`` (..., width) to the span (float32 arithmetic)."""
        basis = self.basis.to(x.dtype)
        res = x - (x @ basis) @ basis.T
        return res.norm(dim=-1) / x.norm(dim=-1).clamp_min(1e-30)


def layer_span(obs: Observation, layer: int, rank_tol: float = 1e-6) -> Span:
    """The span of layer `layer`'s attention inputs from its Q/K/V weight gradients."""
    model = obs.model
    layers = model.attention_layers()
    if layer >= len(layers):
        raise VeilError(f"span needs attention layer {layer + 1}; this model has {len(layers)}")
    att = layers[layer]
    grads = [linear_weight(m, obs.grads[_name(model, m.weight)]) for m in qkv_modules(att) if obs.has_grad(m)]
    if not grads:
        obs.grad(att.q)  # raises the one-line error naming the missing gradient
    g = torch.cat(grads, dim=0).double()
    _, s, vh = torch.linalg.svd(g, full_matrices=False)
    keep = s > rank_tol * s[0] if s.numel() and s[0] > 0 else torch.zeros_like(s, dtype=torch.bool)
    return Span(basis=vh[keep].T.contiguous(), singular=s, width=g.shape[1])


def qkv_modules(att: Any) -> list[nn.Module]:
    """The distinct Q, K, V projections of one attention layer (GPT-2: one fused c_attn)."""
    return list({id(m): m for m in (att.q, att.k, att.v)}.values())


def _name(model: nn.Module, p: nn.Parameter) -> str:
    return next(n for n, q in model.named_parameters() if q is p)


# ----------------------------------------------------------------------------- layer inputs
def first_layer_inputs(model: VeilModel, ids: Tensor, positions: Tensor) -> Tensor:
    """``h0(ids[i], positions[j])`` for all pairs: (len(positions), len(ids), width)."""
    tok = model.token_embedding().weight[ids]  # (V, D)
    pos = model.position_table().reshape(-1, tok.shape[-1])[positions]  # (P, D)
    h = model.assemble(tok.unsqueeze(0).expand(len(positions), -1, -1), pos.unsqueeze(1), {})
    return model.layer_input_norms()[0](h)


class _Stop(Exception):
    pass


@contextmanager
def recording_inputs(mods: list[nn.Module], stop: nn.Module | None = None) -> Iterator[dict[int, Tensor]]:
    """Record (detached) the input each module of `mods` receives, keyed by ``id(module)``; with
    `stop`, the forward pass ends (quietly) as soon as `stop` receives its input."""
    seen: dict[int, Tensor] = {}

    def hook_for(m: nn.Module) -> Any:
        def hook(_m: nn.Module, args: tuple[Tensor, ...]) -> None:
            seen[id(m)] = args[0].detach()
            if m is stop:
                raise _Stop

        return hook

    handles = [m.register_forward_pre_hook(hook_for(m)) for m in {id(m): m for m in mods}.values()]
    try:
        yield seen
    except _Stop:
        pass
    finally:
        for h in handles:
            h.remove()


def layer_inputs(model: VeilModel, ids: Tensor, mask: Tensor | None = None, layer: int = 1) -> Tensor:
    """The input that attention layer `layer`'s Q projection receives for sentences `ids` (N, T)."""
    mask = torch.ones_like(ids) if mask is None else mask
    batch = {"input_ids": ids, "attention_mask": mask}
    q = model.attention_layers()[layer].q
    with recording_inputs([q], stop=q) as seen:
        tok = model.embed_tokens(batch)
        model.forward_from_embeddings(model.assemble(tok, model.position_embeddings(tok), batch), batch)
    return seen[id(q)]


def position_candidates(
    model: VeilModel,
    span: Span,
    max_len: int,
    tol: float,
    chunk: int = 8192,
    max_per_position: int | None = None,
    vocab: Tensor | None = None,
) -> tuple[list[Tensor], list[Tensor]]:
    """Per position t < max_len: ids of tokens (of `vocab`, default all) with d(h0(v, t)) < tol, and their distances.

    Distances are computed in float64 (the true pairs sit at the float32 noise floor of the
    gradient, ~1e-7..1e-4; wrong pairs at >= 1e-3), one matrix product per chunk of
    (position, token) pairs."""
    ids_all = torch.arange(model.token_embedding().weight.shape[0]) if vocab is None else vocab
    per = max(1, chunk // max(1, len(ids_all)))  # positions per chunk
    dists = torch.empty(max_len, len(ids_all), dtype=torch.float64)
    for start in range(0, len(ids_all), chunk):
        ids = ids_all[start : start + chunk]
        for t0 in range(0, max_len, per):
            pos = torch.arange(t0, min(max_len, t0 + per))
            x = first_layer_inputs(model, ids, pos).double()
            dists[pos, start : start + len(ids)] = span.distance(x)
    found, fd = [], []
    for t in range(max_len):
        idx = torch.nonzero(dists[t] < tol).flatten()
        idx = idx[dists[t, idx].argsort()]
        if max_per_position:
            idx = idx[:max_per_position]
        found.append(ids_all[idx])
        fd.append(dists[t, idx].float())
    return found, fd


# ----------------------------------------------------------------------------- the attack
@ATTACKS.register("span", help="DAGER-style exact text recovery from the span of the first layers' Q/K/V gradients")
class SpanAttack(Attack):
    """Settings: ``tol1`` (1e-3), ``tol2`` (1e-3) span-distance tolerances of layers 1 and 2 (raise
    them for dropout), ``rank_tol`` (1e-6), ``max_len`` (knowledge.seq_len, else the model's),
    ``presence_filter`` (True: test only the tokens with embedding gradient), ``layernorm_positions``
    (True) and ``tol_ln`` (1e-4) of the encoder pins, ``restarts`` (4), ``sweeps`` (12) and
    ``budget`` (500000 candidate sentences scored: counted work, so the result does not depend on
    the machine's load) of the encoder search, ``narrow`` (8: the peeling search's sweeps try each
    position's 8 likeliest tokens by the position prior before all of them, where layer 2 has a
    gap; 0 tries all at once), ``beam`` (4*B) of the decoder search,
    ``max_per_position`` (no cap), ``seed``."""

    name = "span"
    knows = "the first layers' Q/K/V gradients, the weights, the vocabulary and batch size; not the defense (naive)"
    modality = "text"

    def applies_to(self, model: VeilModel) -> str | None:
        reason = super().applies_to(model)
        if reason is None and len(model.attention_layers()) < 2:
            return "span needs at least two attention layers to resolve positions"
        return reason

    def _reconstruct(self, obs: Observation, know: Knowledge) -> Reconstruction:
        from veil.attacks.span_peel import Residual, peel_search
        from veil.attacks.span_search import decoder_search, encoder_search

        model = obs.model
        s = self.settings
        tol1, tol2 = float(s.get("tol1", 1e-3)), float(s.get("tol2", 1e-3))
        rank_tol = float(s.get("rank_tol", 1e-6))
        span1, span2 = layer_span(obs, 0, rank_tol), layer_span(obs, 1, rank_tol)
        width = span1.width
        limit = model.position_table().reshape(-1, width).shape[0]
        max_len = int(s.get("max_len") or know.seq_len or limit)
        if max_len > limit:
            raise VeilError(f"span: max_len {max_len} exceeds the model's {limit} positions")
        cap = s.get("max_per_position")
        seed = int(s.get("seed", know.seed))
        if "budget_s" in s:
            raise VeilError(
                "span: budget_s (seconds) was replaced by budget (candidate sentences scored, default 500000)"
            )
        was = model.training
        model.eval()
        pinned = None
        try:
            with torch.no_grad():
                vocab = _vocabulary(obs, know) if s.get("presence_filter", True) else None

                def candidates(span: Span) -> list[Tensor]:
                    return position_candidates(
                        model, span, max_len, tol1, vocab=vocab, max_per_position=int(cap) if cap else None
                    )[0]

                cands = candidates(span1)
                specials = _Specials.of(model, know)
                found, budget = None, int(s.get("budget", 500_000))
                if model.task != "lm" and s.get("peel", True) and know.batch_size:
                    found = peel_search(
                        obs,
                        Residual(obs, know.batch_size),
                        candidates,
                        specials,
                        seed=seed,
                        tol_cls=float(s.get("tol_cls", 1e-4)),
                        rank_tol=rank_tol,
                        budget=budget,
                        prior_weight=float(s.get("prior_weight", 0.2)),
                        narrow=int(s.get("narrow", 8)),
                    )
                    left = budget - (found[1]["sentences_scored"] if found is not None else 0)
                    if found is not None and not found[1]["sentences_exact"] and left > 0:
                        # no sentence passed the exact [CLS] check (e.g. the client shuffled its tokens):
                        # the assignment search below still rebuilds what layer 2 supports, in the budget left
                        budget, found = left, None
                if found is not None:
                    seqs, info = found
                    info = {"search": "peel", **info}
                elif model.task == "lm":
                    seqs, info = decoder_search(
                        model,
                        span2,
                        cands,
                        specials,
                        beam=s.get("beam"),
                        tol2=tol2,
                        seed=seed,
                        batch_size=know.batch_size,
                    )
                else:
                    if s.get("layernorm_positions", True):
                        pinned = pin_positions(obs, cands, float(s.get("tol_ln", 1e-4)))
                        cands = pinned[0] if pinned is not None else cands
                    seqs, info = encoder_search(
                        model,
                        span2,
                        cands,
                        specials,
                        restarts=int(s.get("restarts", 4)),
                        sweeps=int(s.get("sweeps", 12)),
                        budget=budget,
                        pins=pinned[1] if pinned else None,
                        tol2=tol2,
                        seed=seed,
                        batch_size=know.batch_size,
                    )
                    info = {"search": "assignment", **info}
        finally:
            model.train(was)
        stats = {
            "rank1": span1.rank,
            "rank2": span2.rank,
            "width": width,
            "full_rank": span1.rank >= width,
            "layernorm_pins": len(pinned[1]) if pinned else 0,
            "vocabulary": len(vocab) if vocab is not None else "all",
            "candidates_per_position": [len(c) for c in cands if len(c)],
            **info,
        }
        if not seqs:  # nothing passed: say so with empty sentences rather than an empty batch
            seqs = [[] for _ in range(know.batch_size or 1)]
        return Reconstruction(token_ids=seqs, token_set={int(v) for c in cands for v in c.tolist()}, stats=stats)


def _vocabulary(obs: Observation, know: Knowledge) -> Tensor | None:
    """The tokens worth testing: the batch's bag from the token-embedding gradient (`presence`) plus
    the special tokens (a causal LM's final [SEP] gets no gradient); None (whole vocabulary) if that
    gradient is not exported or the embedding is tied to the LM head."""
    from veil.attacks.presence import embedding_row_norms, present_tokens

    if not obs.has_grad(obs.model.token_embedding()):
        return None
    try:
        norms = embedding_row_norms(obs)
    except VeilError:
        return None
    extra = torch.tensor(special_ids(obs.model, know.tokenizer), dtype=torch.long)
    return torch.unique(torch.cat([present_tokens(norms, 1e-7), extra]))


@dataclass
class _Specials:
    cls: int | None
    sep: int | None
    pad: int | None

    @classmethod
    def of(cls, model: VeilModel, know: Knowledge) -> _Specials:
        tok = know.tokenizer
        if tok is not None:
            return cls(getattr(tok, "cls_id", None), getattr(tok, "sep_id", None), getattr(tok, "pad_id", None))
        ids = special_ids(model)
        return cls(ids[1] if len(ids) > 1 else None, ids[2] if len(ids) > 2 else None, ids[0])


# ----------------------------------------------------------------------------- encoder positions
def pin_positions(
    obs: Observation, cands: list[Tensor], floor: float = 1e-4
) -> tuple[list[Tensor], dict[int, int]] | None:
    """Narrow an encoder's per-position candidates with the embedding LayerNorm's Jacobian.

    For ``h = LN(x)``, ``x = E[v] + P[t] + s``, ``c = x - mean(x)``, the backward pass gives
    ``<J^T g, c> = <gamma g, c> / s * eps / (var(x) + eps)``: the LayerNorm removes the direction of
    its own centred input (up to its eps). So if token v occurs at ONE position t (in any number of
    sentences), ``dL/dE[v] = J(v, t)^T g`` and ``|cos(dL/dE[v], c(v, t))| ~< eps / (var + eps)``,
    while at any other position the cosine is generic (~1/sqrt(width)). Such a token is pinned to
    t and removed from every other position's candidates; tokens with no orthogonal position
    occur at several positions and keep their layer-1 candidates. Returns (candidates, pins) or
    None if the model has no embedding LayerNorm or the gradients are not exported.
    """
    model = obs.model
    emb = model.token_embedding()
    if not hasattr(model, "embedding_norm") or not obs.has_grad(emb):
        return None
    T = len(cands)
    if not any(len(c) for c in cands):
        return None
    toks = torch.unique(torch.cat([c for c in cands if len(c)]))
    D = emb.weight.shape[1]
    table = model.position_table().reshape(-1, D)[:T].double()
    x = emb.weight[toks].double()[None] + table[:, None] + model.segment_row().double()
    c = x - x.mean(-1, keepdim=True)
    var = c.pow(2).mean(-1)
    g = obs.grad(emb)[toks].double()
    cos = (c * g).sum(-1).abs() / (c.norm(dim=-1) * g.norm(dim=-1)).clamp_min(1e-300)  # (T, V)
    col = {int(v): j for j, v in enumerate(toks.tolist())}
    allowed = torch.zeros(T, len(toks), dtype=torch.bool)
    for t, ct in enumerate(cands):
        allowed[t, [col[int(v)] for v in ct.tolist()]] = True
    eps = float(getattr(model.embedding_norm(), "eps", 1e-5))
    slack = eps / (var + eps)  # the LayerNorm's leak along its own input; trusted only where it is tiny
    ok = allowed & (cos < torch.where(slack < 1e-3, slack, torch.zeros_like(slack)) + floor) & (g.norm(dim=-1) > 0)
    single = (ok.sum(0) == 1) | (allowed.sum(0) == 1)
    where = torch.where(ok.sum(0) == 1, ok.double().argmax(0), allowed.double().argmax(0))
    pins = {int(toks[j]): int(where[j]) for j in torch.nonzero(single).flatten().tolist()}
    out = [
        torch.tensor([v for v in ct.tolist() if pins.get(int(v), t) == t], dtype=torch.long)
        for t, ct in enumerate(cands)
    ]
    return out, pins
