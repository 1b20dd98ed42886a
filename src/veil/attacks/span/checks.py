"""The exact per-sentence test of the span attack's peeling search (`veil.attacks.span.peel`),
read from the last block's Q projection gradient, for either pooling of an encoder classifier.

The last block's Q projection ``Q = Z W_q^T`` gets ``dL/dW_q = sum_i d_i z_i^T`` over the rows
``z_i`` (last-block inputs) whose query reaches the loss, so its row space is spanned by them:

* [CLS] pooling: only the B [CLS] rows reach the loss (rank <= B); a candidate sentence is in
  the batch iff its own [CLS] input lies in that B-dimensional span (``rows == "cls"``).
* mean pooling (sentence-transformer checkpoints such as all-MiniLM-L6-v2): every real token's
  row reaches the loss (rank <= B*T); where that leaves a gap (rank <= `max_fill` x width) a
  candidate sentence is in the batch iff every one of its last-block inputs lies in the span
  (``rows == "all"``). These inputs mix the whole sentence through all blocks but the last, so
  one wrong token moves every row off the span (relative distance ~0.3 at a third of the width).

`usable` is False otherwise (no gap): the attack then falls back to the layer-2 assignment search.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from veil.attacks.span.core import Span


def row_span(g: Tensor, k: int | None = None, tol: float = 1e-6, region: float = 1e-4, min_drop: float = 3.0) -> Span:
    """Orthonormal basis of the row space of `g`: its top `k` right singular vectors, else those
    above the largest drop (at least `min_drop` x) of the singular values below `region` x the
    largest (the float32 noise floor of a gradient sits just below its weakest real directions,
    so a fixed cut at 1e-6 loses real directions), else those above `tol`."""
    _, s, vh = torch.linalg.svd(g.double(), full_matrices=False)
    if not s.numel() or s[0] <= 0:
        keep = torch.zeros_like(s, dtype=torch.bool)
    elif k is not None:
        keep = torch.arange(len(s), device=s.device) < k
    else:
        rel = (s / s[0]).clamp_min(1e-300)
        drop = rel[:-1] / rel[1:]
        drop[rel[1:] >= region] = 0  # only drops into the small region
        j = int(drop.argmax()) if len(drop) else 0
        keep = torch.arange(len(s), device=s.device) <= j if len(drop) and drop[j] >= min_drop else rel > tol
    return Span(basis=vh[keep].T.contiguous(), singular=s, width=g.shape[1])


class CLSCheck:
    """The exact sentence test of the module docstring, built on the residual gradient `res`
    (`veil.attacks.span.peel.Residual`) with `res.left` sentences left: ``rows`` is "cls" when the
    last block's Q gradient has rank <= left (a [CLS]-pooled classifier), else "all" (every
    token's row reaches the loss, e.g. mean pooling); `usable` says whether the span leaves a gap."""

    def __init__(self, res: Any, rank_gap: float = 1e-5, max_fill: float = 7 / 8) -> None:
        model = res.model
        self.module = model.attention_layers()[-1].q
        k = res.left
        g = res.weight_grad(self.module)
        s = torch.linalg.svdvals(g.double())
        cls_only = k >= 1 and not (k < len(s) and s[k] > rank_gap * s[0])  # rank <= B: a [CLS]-only layer
        self.rows = "cls" if cls_only else "all"
        self.span = row_span(g, k=k) if cls_only else row_span(g)
        self.usable = k >= 1 and (cls_only or 0 < self.span.rank <= max_fill * self.span.width)

    def distance(self, z: Tensor, mask: Tensor | None = None) -> Tensor:
        """(N,) distance of sentences to the span from their last-block inputs `z` (N, T, width):
        the [CLS] row's, or the largest over the real positions (`mask`, default all)."""
        if self.rows == "cls":
            return self.span.distance(z[:, 0].double()).float()
        d = self.span.distance(z.double()).float()
        return (d * mask).amax(1) if mask is not None else d.amax(1)

    def rank_after(self, length: int) -> int:
        """The rank the Q gradient keeps once one true sentence of `length` tokens is subtracted."""
        return self.span.rank - (1 if self.rows == "cls" else length)
