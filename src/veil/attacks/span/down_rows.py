"""One position's first-block MLP activation for many sentences that differ in that position only:
the scoring pass of ``span-down``'s coordinate descent and prefix search (DAGER's span test,
Petrov et al. 2024 eq. 2-3, read at the first down-projection's input).

Candidates that share every token but the one at t share every key and value row but row t, and
only row t of the block's output is read. So the first block's attention is computed at row t
alone, in closed form from its handles (``softmax(q_t K^T / sqrt(d_h)) V`` per head, with K and V
the shared sentence's rows and the candidate's own row t substituted): ``O(N (D^2 + L D))`` work
for N candidates instead of the ``O(N L^2 D)`` of the full pass. The attention module itself runs
on one sentence only (its output is replaced). With ``embed`` the candidates' embeddings are
assembled at row t alone and the blocks get that one row (the shared sentence's attention inputs
come from one full pass), so the embedding, the residual and the MLP see one row per candidate.

The closed form assumes plain multi-head softmax attention over absolute-position inputs with no
padding; `RowScorer` (`veil.attacks.span.down_search`) checks each mode against the full forward
pass on its first call and uses the first that agrees, down to the full pass itself.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from veil.attacks.span.core import model_device, recording_inputs
from veil.attacks.span.rowwise import block1_row
from veil.models.base import AttentionHandles, VeilModel

#: the scoring modes, fastest first (`row_activation`)
MODES = ("embed", "row", "shared", "plain")


def row_activation(model: VeilModel, ids: Tensor, t: int, record: nn.Module, mode: str) -> Tensor:
    """The input `record` (the first block's down-projection) receives at row t for sentences
    `ids` (N, L) that differ at column t only, (N, 1, H) or (N, L, H); `mode` is one of `MODES`:
    ``embed`` feeds the blocks row t alone, ``row`` the whole sentences with the attention at row t
    alone, ``shared`` and ``plain`` are `block1_row`'s."""
    if mode in ("shared", "plain"):
        return block1_row(model, ids, t, record, shared=mode == "shared")
    att = model.attention_layers()[0]
    parent = _parent(model, att.q)
    if parent is None:
        raise ValueError("no module holds the first query projection")
    ids = ids.to(model_device(model))
    saved: dict[str, Tensor] = {}
    if mode == "embed":  # the attention's input rows of the shared sentence, from one full pass
        saved["base"] = _shared_rows(model, parent, ids[:1], record)
    handles = _row_hooks(model, att, parent, saved, t, mode)
    try:
        with torch.no_grad(), recording_inputs([record], stop=record) as seen:
            if mode == "embed":
                _forward_row(model, ids, t)
            else:
                model({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
        return seen[id(record)]
    finally:
        for h in handles:
            h.remove()


def _shared_rows(model: VeilModel, parent: nn.Module, first: Tensor, record: nn.Module) -> Tensor:
    """The attention's input rows (L, D) of the one sentence `first` (1, L), from a full pass that
    stops at `record`."""
    if model.embedding_transform is not None:
        raise ValueError("an embedding transform reads whole sentences")
    saved: dict[str, Tensor] = {}
    hook = parent.register_forward_pre_hook(lambda _m, a: saved.__setitem__("base", a[0][0]))
    try:
        with torch.no_grad(), recording_inputs([record], stop=record):
            model({"input_ids": first, "attention_mask": torch.ones_like(first)})
    finally:
        hook.remove()
    return saved["base"]


def _row_hooks(
    model: VeilModel, att: AttentionHandles, parent: nn.Module, saved: dict[str, Tensor], t: int, mode: str
) -> list[RemovableHandle]:
    """Hooks that run the attention module on the first sentence only and replace its output by
    row t in closed form (`_row_attention`) for every candidate; in ``row`` mode the MLP then
    reads row t alone."""
    heads = int(getattr(parent, "heads", 0) or getattr(parent, "num_attention_heads", 0) or 0)
    apply_o = any(c is att.o for c in parent.children())

    # the attention module's own call arguments: whatever its forward takes (the torch hook API)
    def att_in(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple, dict]:
        x = args[0]
        n = x.shape[0]
        saved["x"] = x

        def first(a: object) -> object:
            return a[:1] if isinstance(a, Tensor) and a.dim() and a.shape[0] == n else a

        return (x[:1], *(first(a) for a in args[1:])), {k: first(v) for k, v in kwargs.items()}

    def att_out(
        _m: nn.Module, _args: tuple[Any, ...], _kwargs: dict[str, Any], out: Tensor | tuple[Tensor | None, ...]
    ) -> Tensor | tuple[Tensor | None, ...]:
        x = saved.pop("x")
        base, rows = (saved["base"], x[:, 0]) if mode == "embed" else (x[0], x[:, t])
        ctx = _row_attention(att, base, rows, t, heads)
        y = att.o(ctx) if apply_o else ctx
        return (y, *([None] * (len(out) - 1))) if isinstance(out, tuple) else y

    handles = [
        parent.register_forward_pre_hook(att_in, with_kwargs=True),
        parent.register_forward_hook(att_out, with_kwargs=True),
    ]
    if mode == "row":
        handles.append(model.mlp_up()[0].register_forward_pre_hook(_row(t)))
    return handles


def _forward_row(model: VeilModel, ids: Tensor, t: int) -> None:
    """The blocks fed row t of each sentence alone: its token and position-t embedding."""
    one = {"input_ids": ids[:, t : t + 1], "attention_mask": torch.ones_like(ids[:, t : t + 1])}
    tok = model.embed_tokens(one)
    pos = model.position_embeddings(tok.new_zeros(1, ids.shape[1], 1))[:, t : t + 1]
    model.forward_from_embeddings(model.assemble(tok, pos, one), one)


def _row_attention(att: AttentionHandles, base: Tensor, rows: Tensor, t: int, heads: int) -> Tensor:
    """Row t of multi-head softmax attention (before the output projection), (N, 1, D), for the
    attention inputs `base` (L, D) with row t replaced by each of `rows` (N, D)."""
    (N, D), L = rows.shape, base.shape[0]
    dh = D // heads
    q = att.q(rows).view(N, heads, dh)
    kt, vt = att.k(rows).view(N, heads, dh), att.v(rows).view(N, heads, dh)
    K, V = att.k(base).view(L, heads, dh), att.v(base).view(L, heads, dh)
    s = torch.einsum("nhd,lhd->nhl", q, K)
    s[:, :, t] = (q * kt).sum(-1)
    p = (s / math.sqrt(dh)).softmax(-1)
    ctx = torch.einsum("nhl,lhd->nhd", p, V) + p[:, :, t, None] * (vt - V[t])
    return ctx.reshape(N, 1, D)


def _parent(model: nn.Module, q: nn.Module) -> nn.Module | None:
    """The module that holds the query projection (the attention)."""
    names = {id(m): n for n, m in model.named_modules()}
    name = names.get(id(q))
    return None if name is None else dict(model.named_modules()).get(name.rpartition(".")[0])


def _row(t: int) -> Callable[[nn.Module, tuple[Tensor, ...]], tuple[Tensor, ...]]:
    def narrow(_m: nn.Module, args: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        return (args[0][:, t : t + 1], *args[1:])

    return narrow
