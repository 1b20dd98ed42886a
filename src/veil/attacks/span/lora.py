"""The span attack on LoRA updates (Petrov et al. 2024, DAGER, sec. 5 "LoRA": the attack on
LLaMA-2's q_proj adapters of rank 256), on veil's span machinery.

A LoRA layer computes ``y = W x + s B A x`` (s = alpha / r) with W and A frozen; the client
exports the adapters' gradients only:

    dL/dB = s sum_i g_i (A x_i)^T          (out, r)
    dL/dA = s B^T sum_i g_i x_i^T          (r, in), zero while B = 0 (at initialisation)

so the row space of dL/dB lies in ``span{A x_i}``, the layer inputs projected to r dimensions by
the frozen (hence known) A: a candidate input x is a layer input iff ``A x`` lies in that span.
The three adapters of one attention layer (q, k, v) see the same inputs through three different
A's; an input x_i enters only the spans of the adapters where its own gradient g_i is not zero (a
causal model's first query attends to itself alone: its q gradient is zero, its k and v ones are
not), so x passes where it lies in the span of at least one of them (`AdapterSpan`: the smallest
of the three distances; a wrong candidate is off every span while each has a gap). The test in r dimensions has a gap only while the tokens that reach the loss
(n; a causal LM's last token gets no gradient) number fewer than r: at n >= r each adapter's span
is all of R^r, every candidate passes, and the attack recovers nothing (rank-limited, not
protected). dL/dB has this form at any B, so the test holds in every round, not only the first.

Layer 1 (first attention layer) admits the (token, position) pairs whose input
``h0(v, t)`` passes (`core.position_candidates`); a model without a position table (RoPE:
llama-tiny) has inputs ``h0(v)`` that do not depend on the position, so layer 1 gives the bag of
tokens, tested at every position. Layer 2's adapters then order them: a causal decoder by
DAGER's left-to-right extension (`search.decoder_search`; with RoPE, the layer-2 input at t is
a function of the prefix, rotations included), an encoder by the assignment search.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from veil.attacks.base import Knowledge, Observation, Reconstruction
from veil.attacks.span.core import PAIRS_PER_CALL, Span, Specials, model_device, position_candidates, qkv_modules
from veil.attacks.span.options import DEFAULTS, SpanOptions
from veil.attacks.span.search import SearchInput, decoder_search, encoder_search
from veil.errors import VeilError
from veil.models.base import NoPositionTable, VeilModel
from veil.models.lora import adapter_pair, is_lora


@dataclass
class AdapterSpan(Span):
    """The spans of one layer's adapters, each in its own r-dimensional space (``blocks``: (span
    of dL/dB's rows, A)); ``basis`` is their block-diagonal sum (its rank: the stats). A layer
    input x is tested as ``min_m w_m d_m(A_m x)`` over the blocks that leave room, weighted by
    the room they leave (`free_dims`, ``one_free_weight``: `SpanOptions.one_free_weight`)."""

    blocks: list[tuple[Span, Tensor]] = field(default_factory=list)
    #: a block whose span leaves one free dimension puts a random candidate within relative distance t
    #: of it with probability ~t (two free dimensions: ~t^2): at the default tolerance 1e-3 one wrong
    #: candidate in a thousand passes, so its distances count this many times over (at the default,
    #: a tolerance of 1e-6 there; true inputs sit at the float32 floor, ~1e-7)
    one_free_weight: float = DEFAULTS.one_free_weight
    #: sentences (N, T, width): a position whose input equals the previous one's fails (see `no_repeats`)
    distinct: bool = False

    def distance(self, x: Tensor) -> Tensor:
        free = [free_dims(span, a) for span, a in self.blocks]
        used = [(span, a, f) for (span, a), f in zip(self.blocks, free) if f > 0]
        if not used:  # every span is all of its space: every candidate passes (the rank limit)
            d = x.new_zeros(x.shape[:-1])
        else:
            d = torch.stack(
                [span.distance(x @ a.to(x.dtype).T) * (self.one_free_weight if f == 1 else 1.0) for span, a, f in used]
            ).amin(0)
        return no_repeats(x, d) if self.distinct and x.ndim == 3 else d


#: two positions' layer inputs are the same where they differ by less than this relative norm (float
#: rounding of identical inputs; a different token moves it by O(1))
SAME = 1e-6


def free_dims(span: Span, a: Tensor) -> int:
    """Dimensions the adapter's span leaves free in the space A maps into (rank min(r, in))."""
    return min(a.shape) - span.rank


def no_repeats(x: Tensor, d: Tensor) -> Tensor:
    """`d` with 1 (off the span) where a sentence's layer input repeats the previous position's.

    Without a position table (RoPE) a prefix of one token repeated, ``v v ... v``, gives the same
    layer-2 input at every position (attention averages identical values), so it passes wherever
    ``v`` is the true first token and would outscore the sentence. Every other extension adds an
    input of its own; one that adds none carries no evidence and is dropped."""
    same = (x[:, 1:] - x[:, :-1]).norm(dim=-1) <= SAME * x[:, 1:].norm(dim=-1)
    out = d.clone()
    out[:, 1:] = torch.where(same, torch.ones_like(d[:, 1:]), d[:, 1:])
    return out


def lora_layers(model: VeilModel) -> bool:
    """Whether the first attention layer's Q/K/V carry LoRA adapters (the attack's span source)."""
    try:
        return any(is_lora(m) for m in qkv_modules(model.attention_layers()[0]))
    except (NotImplementedError, IndexError):
        return False


def adapter_span(
    obs: Observation, layer: int, rank_tol: float = DEFAULTS.rank_tol, one_free_weight: float = DEFAULTS.one_free_weight
) -> AdapterSpan:
    """The span of attention layer `layer`'s inputs, projected by its adapters' A (see the module
    docstring): each exported dL/dB's row space with its A."""
    layers = obs.model.attention_layers()
    if layer >= len(layers):
        raise VeilError(f"span: needs attention layer {layer + 1}; this model has {len(layers)}")
    mods: list[nn.Module] = [m for m in qkv_modules(layers[layer]) if is_lora(m)]
    bases, projs, sings = [], [], []
    for m in mods:
        a, b, _ = adapter_pair(m)
        if not obs.has_grad(b):
            continue
        g = obs.grad(b).double()  # (out, r): s G (A X)^T
        _, s, vh = torch.linalg.svd(g, full_matrices=False)
        keep = s > rank_tol * s[0] if s.numel() and s[0] > 0 else torch.zeros_like(s, dtype=torch.bool)
        bases.append(vh[keep].T)
        projs.append(a.detach().double())
        sings.append(s)
    if not bases:
        raise VeilError(
            f"span: the update holds no LoRA adapter gradient of attention layer {layer + 1}'s Q/K/V "
            "(adapters frozen, e.g. by aegis, or not targeted: train.lora.targets)"
        )
    blocks = [(Span(basis=b, singular=s, width=a.shape[0]), a) for b, s, a in zip(bases, sings, projs)]
    return AdapterSpan(
        basis=torch.block_diag(*bases),
        singular=torch.cat(sings),
        width=projs[0].shape[1],
        blocks=blocks,
        one_free_weight=one_free_weight,
    )


def token_candidates(model: VeilModel, span: Span, tol: float, chunk: int = PAIRS_PER_CALL) -> Tensor:
    """Tokens v whose first-layer input ``h0(v)`` passes, for a model without a position table
    (its first-layer input does not depend on the position)."""
    emb = model.token_embedding().weight
    dev = model_device(model)
    found = []
    for start in range(0, emb.shape[0], chunk):
        ids = torch.arange(start, min(emb.shape[0], start + chunk), device=dev)
        tok = emb[ids].unsqueeze(0)
        h = model.layer_input_norms()[0](model.assemble(tok, torch.zeros_like(tok), {}))[0]
        found.append(ids[span.distance(h.double()).cpu() < tol].cpu())
    return torch.cat(found)


def lora_reconstruct(options: SpanOptions, obs: Observation, know: Knowledge) -> Reconstruction:
    """The span attack of the module docstring with `options` (`SpanOptions`: tol1, tol2, rank_tol,
    max_len, max_per_position, restarts, sweeps, budget, beam, seed)."""
    model, o = obs.model, options
    span1 = adapter_span(obs, 0, o.rank_tol, o.one_free_weight)
    span2 = adapter_span(obs, 1, o.rank_tol, o.one_free_weight)
    max_len, table = _max_len(model, span1, span2, o, know)
    budget = o.sentences(know.batch_size or 1)
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            if table:
                cands = position_candidates(model, span1, max_len, o.tol1, max_per_position=o.max_per_position)[0]
            else:
                cands = [token_candidates(model, span1, o.tol1)] * max_len
            seqs, info = _search(
                SearchInput(model, span2, cands, Specials.of(model, know), o.tol2, know.batch_size), o, know, budget
            )
    finally:
        model.train(was)
    stats = {
        "source": "lora",
        "rank1": span1.rank,
        "rank2": span2.rank,
        "adapter_ranks": [int(span.rank) for span, _ in span1.blocks],
        "full_rank": all(free_dims(span, a) <= 0 for span, a in span1.blocks),
        "width": span1.width,
        "candidates_per_position": [len(c) for c in cands if len(c)],
        **info,
    }
    scored = int(info.get("sentences_scored", info.get("prefixes_tested", 0)))
    stats.update(work={"sentences_scored": scored}, budget_stopped=scored >= budget)
    seqs = seqs or [[] for _ in range(know.batch_size or 1)]
    return Reconstruction(token_ids=seqs, token_set={int(v) for c in cands for v in c.tolist()}, stats=stats)


def _max_len(
    model: VeilModel, span1: AdapterSpan, span2: AdapterSpan, o: SpanOptions, know: Knowledge
) -> tuple[int, bool]:
    """The longest sentence searched and whether the model has a position table; without one
    (RoPE) layer 2 refuses repeated inputs (`AdapterSpan.distinct`)."""
    try:
        limit = model.position_table().reshape(-1, span1.width).shape[0]
        table = True
    except NoPositionTable:
        limit, table = model.max_positions(), False
        span2.distinct = True
    max_len = int(o.max_len or know.seq_len or limit)
    if max_len > limit:
        raise VeilError(f"span: max_len {max_len} exceeds the model's {limit} positions")
    return max_len, table


def _search(inp: SearchInput, o: SpanOptions, know: Knowledge, budget: int) -> tuple[list[list[int]], dict[str, Any]]:
    """Layer 2 on the adapters' span: left to right (decoders) or the assignment search (encoders)."""
    if inp.model.task == "lm":
        return decoder_search(inp, beam=o.beam, per_sentence=o.beam_per_sentence, budget=budget)
    seed = know.seed if o.seed is None else o.seed
    seqs, info = encoder_search(inp, o, seed=seed, budget=budget)
    return seqs, {"search": "assignment", **info}


__all__ = ["AdapterSpan", "adapter_span", "lora_layers", "lora_reconstruct", "token_candidates"]
