"""The decoder search's scorer (`veil.attacks.span.search.decoder_search`; DAGER alg. 1, Petrov et
al. 2024, eq. 2-3): the layer-2 span distance of the last position of each extension of a prefix,
computed through block 1 for that one row.

An extension step appends each of K candidate tokens to each of P prefixes of length t and reads
the layer-2 input at position t alone. In a causal decoder that row depends on the prefix and the
new token only, and block 1's work for it reduces to:

* the keys and values of the prefix: block 1's input is a function of (token, position) alone
  (the embeddings), so its Q/K/V projections are computed once per distinct (token, position)
  pair of the step and shared by every extension of a prefix (a key/value cache);
* one query per new token, its attention over the prefix's keys and its own, then the output
  projection, the residual and the MLP on that row alone.

`block_rows` computes this directly for a pre-LN block whose parts it knows (GPT-2, veil's
decoder: `RowBlock.of`); `last_rows` gets most of it for any decoder by hooks on block 1 (Q/K/V
once per distinct (token, position), the output projection and the MLP on the last row; the
attention itself over every row); `full_rows` runs the full forward pass of every extension. The
first two give the full pass's distances up to float32 rounding: the scorer checks that on its
first step with a prefix (where attention mixes rows) against the full pass, and keeps the fastest
way that agrees. A span whose test reads whole sentences (`AdapterSpan.distinct`: a position
against the one before it) always gets the full pass.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from veil.attacks.span.core import (
    ACT_FLOATS,
    Span,
    layer_inputs,
    model_device,
    qkv_modules,
    recording_inputs,
    rows_per_call,
)
from veil.models.base import VeilModel

#: extensions the first step scores both ways, and the relative difference of their layer-2
#: inputs the check accepts (float32 rounding of a block is ~1e-6 of a row's norm)
CHECK_PREFIXES, CHECK_TOKENS = 2, 4
CHECK_TOL = 1e-4

#: layer-2 inputs (P * K, width) of the K extensions of each of P prefixes (P, t), prefix-major (the
#: full pass: every position, (P * K, t + 1, width))
Rows = Callable[[VeilModel, Tensor, Tensor], Tensor]


class LastRowScorer:
    """Layer-2 span distances of the last position of prefixes extended by tokens, on the CPU in
    float32 (module docstring); scored in calls sized to memory (`rows_per_call`)."""

    def __init__(self, model: VeilModel, span2: Span) -> None:
        self.model, self.span2 = model, span2
        ways: list[Rows] = [block_rows] if RowBlock.of(model) is not None else []
        self.ways = [] if getattr(span2, "distinct", False) else [*ways, last_rows]
        self.checked = False

    @property
    def way(self) -> Rows:
        """The fastest way of computing the rows that agreed with the full pass (or that pass)."""
        return self.ways[0] if self.ways else full_rows

    def __call__(self, prefixes: Tensor, toks: Tensor, n: int) -> Tensor:
        """Distances (n,) of the first n extensions ``prefixes[i] + [toks[j]]`` in the order
        (i, j) (prefix-major): the n that fit the search's budget."""
        P, t = prefixes.shape
        K = len(toks)
        if not self.checked and t >= 1:
            self.checked = True
            sub, few = prefixes[:CHECK_PREFIXES], toks[:CHECK_TOKENS]
            self.ways = [w for w in self.ways if agrees(w, self.model, sub, few)]
        per = max(1, rows_per_call(self.model, (t + 1) * self.span2.width * ACT_FLOATS * 4) // max(1, K))
        need = min(P, -(-n // max(1, K)))  # the prefixes whose extensions are scored
        with torch.no_grad():
            parts = [self._distances(prefixes[i : min(i + per, need)], toks) for i in range(0, need, per)]
        return torch.cat(parts)[:n] if parts else torch.zeros(0)

    def _distances(self, prefixes: Tensor, toks: Tensor) -> Tensor:
        """The last position's distances; the full pass's rows are whole sentences (a span may
        read a position against the one before it)."""
        d = self.span2.distance(self.way(self.model, prefixes, toks)).float().cpu()
        return d[:, -1] if d.ndim == 2 else d


def extended(prefixes: Tensor, toks: Tensor) -> Tensor:
    """The extensions (P * K, t + 1), prefix-major."""
    P, K = len(prefixes), len(toks)
    return torch.cat([prefixes.repeat_interleave(K, dim=0), toks.repeat(P)[:, None]], dim=1)


def full_rows(model: VeilModel, prefixes: Tensor, toks: Tensor) -> Tensor:
    """The layer-2 inputs (P * K, t + 1, width) of every extension, every position, by the full
    forward pass."""
    ids = extended(prefixes, toks)
    return layer_inputs(model, ids, torch.ones_like(ids))


def agrees(way: Rows, model: VeilModel, prefixes: Tensor, toks: Tensor) -> bool:
    """Whether `way` matches the full forward pass on these extensions (float32 rounding)."""
    with torch.no_grad():
        full = full_rows(model, prefixes, toks)[:, -1]
        try:
            fast = way(model, prefixes, toks)
        except (AttributeError, IndexError, RuntimeError, TypeError):  # a block whose shapes differ
            return False
    if fast.shape != full.shape:
        return False
    gap = (fast - full).norm(dim=-1) / full.norm(dim=-1).clamp_min(1e-30)
    return bool((gap < CHECK_TOL).all())


@dataclass(frozen=True)
class RowBlock:
    """What `block_rows` needs of block 1 besides veil's handles: its heads, the attention's
    score scale, the second LayerNorm and the MLP (a pre-LN block ``x + attn(ln1 x)``, then
    ``x + mlp(ln2 x)``)."""

    heads: int
    scale: float
    norm2: nn.Module
    mlp: nn.Module

    @classmethod
    def of(cls, model: VeilModel) -> RowBlock | None:
        """Block 1's parts for HF GPT-2 and veil's pre-LN decoder in eval mode; None otherwise."""
        from veil.models.decoder import Decoder
        from veil.models.hf import HFGPT2

        if model.training:
            return None
        try:
            if isinstance(model, HFGPT2):
                b = model.hf.transformer.h[0]
                return cls(int(b.attn.num_heads), float(b.attn.scaling), b.ln_2, b.mlp)
            if isinstance(model, Decoder) and model.blocks[0].prenorm:
                b = model.blocks[0]
                return cls(int(b.attn.heads), float(model.width // b.attn.heads) ** -0.5, b.ln2, b.mlp)
        except AttributeError:  # a wrapped model (e.g. adapters) that hides these parts
            return None
        return None


def block_rows(model: VeilModel, prefixes: Tensor, toks: Tensor) -> Tensor:
    """The last position's layer-2 input (P * K, width) of each extension, computed directly
    (module docstring): the prefixes' keys and values once per distinct (token, position)."""
    blk = RowBlock.of(model)
    assert blk is not None  # the scorer only offers this way where the block is known
    dev = model_device(model)
    P, t = prefixes.shape
    x, qkv, inverse = _pair_rows(model, prefixes.to(dev), toks.to(dev))
    D = x.shape[-1]
    d = D // blk.heads
    heads = qkv[inverse].view(-1, 3, blk.heads, d)  # (P * t + K, 3, h, d)
    kp, vp = (heads[: P * t, i].view(P, t, blk.heads, d).transpose(1, 2) for i in (1, 2))  # (P, h, t, d)
    qn, kn, vn = (heads[P * t :, i].transpose(0, 1) for i in (0, 1, 2))  # (h, K, d)
    past = qn[None] @ kp.transpose(-1, -2) * blk.scale  # (P, h, K, t)
    own = (qn * kn).sum(-1)[None, :, :, None].expand(P, -1, -1, 1) * blk.scale
    att = torch.cat([past, own], dim=-1).softmax(dim=-1)
    out = att[..., :t] @ vp + att[..., t:] * vn[None]  # (P, h, K, d)
    y = model.attention_layers()[0].o(out.permute(0, 2, 1, 3).reshape(-1, D)) + x[inverse[P * t :]].repeat(P, 1)
    y = y + blk.mlp(blk.norm2(y))
    return model.layer_input_norms()[1](y)


def _pair_rows(model: VeilModel, prefixes: Tensor, toks: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Block 1's input rows x (U, width) and their Q/K/V (U, 3 * width) for the distinct (token,
    position) pairs of the prefixes (positions < t) and the new tokens (position t), and each
    pair's row (P * t + K,): the prefixes' pairs row-major, then the new tokens'."""
    dev = prefixes.device
    P, t = prefixes.shape
    ids = torch.cat([prefixes.reshape(-1), toks])
    at = torch.cat([torch.arange(t, device=dev).repeat(P), torch.full((len(toks),), t, device=dev)])
    pairs, inverse = torch.unique(ids * (t + 1) + at, return_inverse=True)
    emb = model.token_embedding().weight
    table = model.position_table().reshape(-1, emb.shape[-1])
    x = model.assemble(emb[pairs // (t + 1)][None], table[pairs % (t + 1)][None], {})[0]
    u = model.layer_input_norms()[0](x)
    mods = qkv_modules(model.attention_layers()[0])
    qkv = mods[0](u) if len(mods) == 1 else torch.cat([m(u) for m in mods], dim=-1)
    return x, qkv, inverse


def last_rows(model: VeilModel, prefixes: Tensor, toks: Tensor) -> Tensor:
    """The last position's layer-2 input of each extension by the model's own forward pass with
    hooks on block 1: Q/K/V once per distinct (token, position), the output projection and the
    MLP on the last row alone."""
    dev = model_device(model)
    ids = extended(prefixes, toks).to(dev)
    att, record = model.attention_layers()[0], model.attention_layers()[1].q
    key = ids * ids.shape[1] + torch.arange(ids.shape[1], device=dev)
    _, inverse = torch.unique(key.flatten(), return_inverse=True)
    first = torch.empty(int(inverse.max()) + 1, dtype=torch.long, device=dev)
    first.scatter_(0, inverse, torch.arange(inverse.numel(), device=dev))  # one occurrence of each pair
    handles = []
    for m in qkv_modules(att):
        handles += [m.register_forward_pre_hook(_gather_in(first)), m.register_forward_hook(_scatter_out(inverse, ids))]
    ups = model.mlp_up_groups()[0]
    handles += [m.register_forward_pre_hook(_last_row) for m in [att.o, *ups]]
    try:
        with recording_inputs([record], stop=record) as seen:
            model({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
        return seen[id(record)][:, -1]
    finally:
        for h in handles:
            h.remove()


def _gather_in(first: Tensor) -> Any:
    def take(_m: nn.Module, args: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        x = args[0]
        return (x.reshape(-1, x.shape[-1])[first].unsqueeze(0), *args[1:])

    return take


def _scatter_out(inverse: Tensor, ids: Tensor) -> Any:
    def put(_m: nn.Module, _args: tuple[Tensor, ...], out: Tensor) -> Tensor:
        return out[0][inverse.view(ids.shape)]

    return put


def _last_row(_m: nn.Module, args: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    return (args[0][:, -1:], *args[1:])
