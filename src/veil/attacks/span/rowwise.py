"""One position's cost without the rest of block 1's work: the hooks the span attack's growth
(`veil.attacks.span.suffix`) scores through (DAGER's span test, Petrov et al. 2024 eq. 2-3, read at
one row of block 1's MLP input or of layer 2's input).

A growth step scores the candidates for one position t - 1 by the cost at t alone, and its
sentences agree everywhere else. In block 1 that leaves most of the work shared or unused:

* each Q/K/V row depends only on its own token and position (block 1's input is the embeddings),
  so the rows of the columns where no sentence differs are computed once, from the first sentence,
  and only the varied columns per sentence;
* only row t of the attention output is read, so the output projection gets that row alone (the
  residual after it broadcasts it over the others, which nothing reads);
* the MLP is position-wise, so its up-projection gets row t alone as well.

The costs are then those of the full forward pass at row t up to float32 rounding; each score that
uses these hooks checks that on its first call and falls back to the full pass where it does not
hold (a model whose block 1 is built differently).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from veil.attacks.span.core import model_device, recording_inputs
from veil.models.base import VeilModel


def block1_row(model: VeilModel, ids: Tensor, t: int, record: nn.Module, shared: bool) -> Tensor:
    """The input `record` (a module at or after block 1's MLP) receives for sentences `ids` when
    block 1's MLP computes row t only, and with `shared` its attention the shared rows as well
    (module docstring); the forward pass stops at `record`."""
    handles = [model.mlp_up()[0].register_forward_pre_hook(_row(t))]
    if shared:
        handles += _shared_rows(model, ids, t)
    try:
        with torch.no_grad(), recording_inputs([record], stop=record) as seen:
            dev = model_device(model)
            model({"input_ids": ids.to(dev), "attention_mask": torch.ones_like(ids).to(dev)})
        return seen[id(record)]
    finally:
        for h in handles:
            h.remove()


def _row(t: int) -> Any:
    def narrow(_m: nn.Module, args: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        return (args[0][:, t : t + 1], *args[1:])

    return narrow


def _shared_rows(model: VeilModel, ids: Tensor, t: int) -> list[Any]:
    """Hooks on block 1's attention: Q/K/V of the columns where no sentence differs computed once,
    the output projection on row t alone. Returns the hook handles."""
    att = model.attention_layers()[0]
    cols = torch.nonzero((ids != ids[:1]).any(0)).flatten().to(model_device(model))
    saved: dict[int, Tensor] = {}

    def take(m: nn.Module, args: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        saved[id(m)] = args[0][:1]
        return (args[0][:, cols], *args[1:])

    def put(m: nn.Module, _args: tuple[Tensor, ...], out: Tensor) -> Tensor:
        base = m.forward(saved.pop(id(m)))
        full = base.expand(out.shape[0], *base.shape[1:]).clone()
        full[:, cols] = out
        return full

    qkv = list({id(m): m for m in (att.q, att.k, att.v)}.values())
    handles = [m.register_forward_pre_hook(take) for m in qkv] + [m.register_forward_hook(put) for m in qkv]
    return [*handles, att.o.register_forward_pre_hook(_row(t))]
