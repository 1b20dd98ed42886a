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
position), so every vocabulary token is tested at every position in vectorised chunks:
``S_t = {v : d(h0(v, t)) < tol1}``. The first layer alone admits every batch token at its
position but does not say which sentence it belongs to; layer 2 (its input is the first block's
output, which mixes the whole sentence) resolves that, in `veil.attacks.span_search`:
greedy left-to-right extension for causal decoders (DAGER alg. 1; the layer-2 input at t depends
only on tokens <= t) and an assignment search for bidirectional encoders.

Dropout makes the layer inputs ``mask * x / (1 - p)``: no longer in the span of clean vectors.
``tol1``/``tol2`` are then the tolerance to raise (see the report for measured effects).
"""
from __future__ import annotations

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
    mods = list({id(m): m for m in (att.q, att.k, att.v)}.values())  # GPT-2: one fused c_attn
    grads = [linear_weight(m, obs.grads[_name(model, m.weight)]) for m in mods if obs.has_grad(m)]
    if not grads:
        obs.grad(att.q)  # raises the one-line error naming the missing gradient
    g = torch.cat(grads, dim=0).double()
    _, s, vh = torch.linalg.svd(g, full_matrices=False)
    keep = s > rank_tol * s[0] if s.numel() and s[0] > 0 else torch.zeros_like(s, dtype=torch.bool)
    return Span(basis=vh[keep].T.contiguous(), singular=s, width=g.shape[1])


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


def layer_inputs(model: VeilModel, ids: Tensor, mask: Tensor | None = None, layer: int = 1) -> Tensor:
    """The input that attention layer `layer`'s Q projection receives for sentences `ids` (N, T)."""
    mask = torch.ones_like(ids) if mask is None else mask
    batch = {"input_ids": ids, "attention_mask": mask}
    seen: list[Tensor] = []

    def grab(_m: nn.Module, args: tuple[Tensor, ...]) -> None:
        seen.append(args[0])
        raise _Stop

    handle = model.attention_layers()[layer].q.register_forward_pre_hook(grab)
    try:
        h = model.assemble(model.embed_tokens(batch), model.position_embeddings(model.embed_tokens(batch)), batch)
        model.forward_from_embeddings(h, batch)
    except _Stop:
        pass
    finally:
        handle.remove()
    return seen[0]


def position_candidates(model: VeilModel, span: Span, max_len: int, tol: float, chunk: int = 8192,
                        max_per_position: int | None = None) -> tuple[list[Tensor], list[Tensor]]:
    """Per position t < max_len: ids of vocabulary tokens with d(h0(v, t)) < tol, and their distances."""
    vocab = model.token_embedding().weight.shape[0]
    dists = torch.empty(max_len, vocab, dtype=torch.float32)
    for t in range(max_len):  # positions x vocabulary chunks, each chunk one matrix product
        for start in range(0, vocab, chunk):
            ids = torch.arange(start, min(vocab, start + chunk))
            dists[t, start:start + len(ids)] = span.distance(first_layer_inputs(model, ids, torch.tensor([t])))[0].float()
    found, fd = [], []
    for t in range(max_len):
        idx = torch.nonzero(dists[t] < tol).flatten()
        idx = idx[dists[t, idx].argsort()]
        if max_per_position:
            idx = idx[:max_per_position]
        found.append(idx)
        fd.append(dists[t, idx])
    return found, fd


# ----------------------------------------------------------------------------- the attack
@ATTACKS.register("span", help="DAGER-style exact text recovery from the span of the first layers' Q/K/V gradients")
class SpanAttack(Attack):
    """Settings: ``tol1`` (1e-3), ``tol2`` (1e-3) span-distance tolerances of layers 1 and 2 (raise
    them for dropout), ``rank_tol`` (1e-6), ``max_len`` (knowledge.seq_len, else the model's),
    ``restarts`` (4) and ``sweeps`` (12) of the encoder search, ``beam`` (4*B) of the decoder
    search, ``max_per_position`` (no cap), ``seed``."""

    name = "span"
    modality = "text"

    def applies_to(self, model: VeilModel) -> str | None:
        reason = super().applies_to(model)
        if reason is None and len(model.attention_layers()) < 2:
            return "span needs at least two attention layers to resolve positions"
        return reason

    def _reconstruct(self, obs: Observation, know: Knowledge) -> Reconstruction:
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
        was = model.training
        model.eval()
        try:
            with torch.no_grad():
                cands, cdist = position_candidates(model, span1, max_len, tol1, max_per_position=int(cap) if cap else None)
                narrowed = None
                if model.task != "lm" and s.get("layernorm_positions", True):
                    narrowed = layernorm_positions(obs, cands, float(s.get("tol_ln", 1e-2)))
                    cands = narrowed if narrowed is not None else cands
                specials = _Specials.of(model, know)
                opts: dict[str, Any] = {"tol2": tol2, "seed": int(s.get("seed", know.seed)), "batch_size": know.batch_size}
                if model.task == "lm":
                    seqs, info = decoder_search(model, span2, cands, specials, beam=s.get("beam"), **opts)
                else:
                    seqs, info = encoder_search(model, span2, cands, specials, restarts=int(s.get("restarts", 4)),
                                                sweeps=int(s.get("sweeps", 12)), **opts)
        finally:
            model.train(was)
        stats = {"rank1": span1.rank, "rank2": span2.rank, "width": width, "full_rank": span1.rank >= width, "layernorm_positions": narrowed is not None,
                 "candidates_per_position": [len(c) for c in cands if len(c)], **info}
        return Reconstruction(token_ids=seqs, token_set={int(v) for c in cands for v in c.tolist()}, stats=stats)


@dataclass
class _Specials:
    cls: int | None
    sep: int | None
    pad: int | None

    @classmethod
    def of(cls, model: VeilModel, know: Knowledge) -> "_Specials":
        tok = know.tokenizer
        if tok is not None:
            return cls(getattr(tok, "cls_id", None), getattr(tok, "sep_id", None), getattr(tok, "pad_id", None))
        ids = special_ids(model)
        return cls(ids[1] if len(ids) > 1 else None, ids[2] if len(ids) > 2 else None, ids[0])


# ----------------------------------------------------------------------------- encoder positions
def _orth(g: Tensor, x: Tensor) -> Tensor:
    """|cos| between gradients g (..., D) and the centred LayerNorm inputs x (..., D)."""
    xc = x - x.mean(-1, keepdim=True)
    return (xc * g).sum(-1).abs() / (xc.norm(dim=-1) * g.norm(dim=-1)).clamp_min(1e-30)


def _clear_minimum(cos: Tensor, tol: float) -> Tensor:
    """Per column: the smallest |cos| is below `tol` and 4x below the runner-up (LayerNorm eps makes it inexact)."""
    if cos.shape[0] < 2:
        return cos[0] < tol
    two = cos.topk(2, dim=0, largest=False).values
    return (two[0] < tol) & (two[0] < 0.25 * two[1])


def layernorm_positions(obs: Observation, cands: list[Tensor], tol: float = 1e-3) -> list[Tensor] | None:
    """Narrow an encoder's per-position candidates with the embedding LayerNorm's Jacobian.

    For ``h = LN(x)``, ``x = E[v] + P[t] + s``, the backward pass gives ``dL/dx = J^T dL/dh`` with
    ``J^T`` projecting out ``1`` and the centred ``x`` (LN is invariant to shifting and scaling x).
    So ``dL/dE[v]`` is orthogonal to ``x(v, t) - mean`` when v occurs at one position t only (in any
    number of sentences), which pins that token to t; for tokens at several positions, the
    position gradient ``dL/dP[t]`` minus the pinned tokens' rows leaves their share at t, which is
    orthogonal to ``x(v, t)`` if one of them is there. None if the model or gradients do not allow it.
    """
    model = obs.model
    emb = model.token_embedding()
    if not hasattr(model, "embedding_norm") or not obs.has_grad(emb) or not obs.has_grad(model.position_table()):
        return None
    T = len(cands)
    present = torch.unique(torch.cat([c for c in cands if len(c)])) if any(len(c) for c in cands) else None
    if present is None:
        return None
    g_tok = obs.grad(emb)[present].float()
    g_pos = obs.grad(model.position_table()).reshape(-1, g_tok.shape[-1])[:T].float()
    x = emb.weight[present][None] + model.position_table().reshape(-1, g_tok.shape[-1])[:T, None] + model.segment_row()
    cos = _orth(g_tok[None], x)  # (T, P)
    single = _clear_minimum(cos, tol)  # tokens orthogonal at exactly one position
    pinned = torch.zeros_like(cos, dtype=torch.bool)
    pinned[cos.argmin(0)[single], torch.nonzero(single).flatten()] = True
    rest = g_pos - pinned.float() @ g_tok  # each position's gradient not explained by pinned tokens
    multi = present[~single]
    out = []
    for t in range(T):
        allowed = set(cands[t].tolist())
        mine = [int(v) for v in present[pinned[t]].tolist() if int(v) in allowed]
        if len(multi) and rest[t].norm() > 1e-3 * g_pos[t].norm().clamp_min(1e-30):
            c = _orth(rest[t][None], x[t, ~single])
            extra = multi[c < tol] if bool((c < tol).any()) else multi
            mine += [int(v) for v in extra.tolist() if int(v) in allowed]
        out.append(torch.tensor(sorted(set(mine)), dtype=torch.long))
    return out
