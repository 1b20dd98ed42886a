"""The MLP down-projection objective of the span attack's peeling search (`veil.attacks.span.peel`)
for batches whose layer-2 span is crowded or full: DAGER's span test (Petrov et al. 2024, eq. 2-3)
applied to the second linear layer of a block's MLP instead of its Q/K/V projections.

A block's MLP down-projection ``y_i = W a_i`` (W: width x hidden, hidden = 4 x width on MiniLM)
gets ``dL/dW = sum_i delta_i a_i^T`` over every real token i of the batch, ``a_i`` the block's
hidden activation (after the non-linearity). Its row space lies in ``span{a_i}`` and has rank
<= min(B*T, width):

* below `width` real tokens it is ``span{a_i}`` itself, inside a space four times wider than
  layer 2's input: an exact per-position test like layer 2's, with far more room around it
  (a true sentence's rows at float rounding, one wrong token far off);
* past `width` real tokens (where the layer-2 span is full) it keeps a (width - 1)-dimensional
  part of ``span{a_i}``: no longer exact, but graded (the mean distance per position grows with
  the number of wrong tokens; `benchmarks/span_scale.py --signal` measures it).

``a_i`` depends on the whole sentence (after attention), so the relative distance of each
position's ``a_i`` to that row space (as `Span.distance`) is a per-position cost of a complete
candidate sentence: `MLPScore` is a drop-in `SentenceScore` whose per-position cost is the sum of
these distances over the first `blocks` blocks. Block 1's is the sharpest per position (the
true token ranks first more often than with the sum over later blocks) and the cheapest (the
forward pass stops at block 1's MLP).
The exact sentence test stays the last block's ([CLS] / all-row) check (`CLSCheck`), computed
only where the walk settles (``with_cls=False``), and the residual (`Residual`) subtracts every
found sentence from the MLP gradients as from the others, so the test regains its exactness as
sentences are peeled.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from veil.attacks.span.checks import CLSCheck, RowCheck, row_span
from veil.attacks.span.core import ACT_FLOATS, Span, model_device, rows_per_call
from veil.attacks.span.options import DEFAULTS
from veil.attacks.span.residual import Residual
from veil.attacks.span.rowwise import block1_row
from veil.attacks.span.score import ROW_BLOCKS, PositionPrior, SentenceScore, _probe
from veil.models.base import VeilModel


def mlp_spans(res: Residual, blocks: int) -> list[tuple[nn.Module, Span]]:
    """The row spans of the first `blocks` blocks' MLP down-projection gradients (of the residual),
    with their modules; empty where the model has no MLP or the gradients are not kept."""
    out = []
    for m in res.model.mlp_down()[:blocks]:
        name = res.names.get(id(getattr(m, "weight", None)))
        if name is None or name not in res.grads:
            break
        out.append((m, row_span(res.weight_grad(m))))
    return out


def mlp_usable(spans: list[tuple[nn.Module, Span]], max_fill: float = DEFAULTS.mlp_max_fill) -> bool:
    """Whether the MLP spans leave room: each keeps at most `max_fill` of its hidden width (its
    rank is at most the model's width, a quarter of a 4x MLP), so a wrong sentence's activations
    have room to leave it."""
    return bool(spans) and all(0 < sp.rank <= max_fill * sp.width for _, sp in spans)


def mlp_exact(spans: list[tuple[nn.Module, Span]]) -> bool:
    """Whether every MLP span is below its rank limit: then it is ``span{a_i}`` itself and the test
    exact (a true sentence's rows at float rounding, one wrong token far off), else a part of it
    and the test graded. The limit is the projection's output width less one: a post-LN block's output gradient is centred by its LayerNorm, so a full span has
    rank width - 1, and a pre-LN one at width - 1 is taken as full too (the safe side)."""
    return bool(spans) and mlp_fill(spans) < 1


def mlp_fill(spans: list[tuple[nn.Module, Span]]) -> float:
    """How full the MLP spans are: the largest rank / rank limit (`mlp_exact`'s limit, the
    projection's output width less one); 0 without spans."""
    return max((sp.rank / max(1, int(getattr(m, "out_features", sp.width)) - 1) for m, sp in spans), default=0.0)


#: tolerance of the shared-rows self-check (`MLPScore.at`): float32 rounding of two orders of the
#: same sums, far below what a wrong row would differ by
SAME = 1e-4


class MLPScore(SentenceScore):
    """Per-position cost: the sum over the first blocks of each position's MLP-down input distance
    to that block's gradient row space (module docstring); the [CLS] distance (`CLSCheck`) as in
    `SentenceScore` (``with_cls=True``: in the same forward pass; else +inf, and `cls` on demand)."""

    def __init__(
        self,
        model: VeilModel,
        spans: list[tuple[nn.Module, Span]],
        span2: Span,
        check: CLSCheck | RowCheck,
        with_cls: bool = False,
        prior: PositionPrior | None = None,
    ) -> None:
        super().__init__(model, span2, check, with_cls=with_cls, prior=prior)
        self.tok_grad = None
        self.spans = spans
        self.bases = [sp.basis.float().to(model_device(model)) for _, sp in spans]
        self._rowwise: bool | None = None  # whether `at` may feed the MLP one row (None: not tried yet)
        self.rows_shared: bool | None = None  # whether `at` may share block 1's rows (`_shared_rows`)

    def rows_per_call(self, n: int) -> int:
        """Candidate sentences of `n` tokens one scoring call may hold: the activations of the
        blocks it runs (all with the [CLS] distance, else those up to the last MLP used), within
        `CALL_BYTES` on the CPU, a quarter of the free memory on a GPU."""
        layers = len(self.model.attention_layers()) if self.with_cls else len(self.spans)
        return rows_per_call(self.model, n * self.span2.width * layers * ACT_FLOATS * 4)

    def _scores(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        mods = [m for m, _ in self.spans]
        stop = self.check.module if self.with_cls else mods[-1]
        self.meter.charge(len(ids), ids.shape[1], self.depth if self.with_cls else len(mods))
        with torch.no_grad():
            seen = _probe(
                self.model, [*mods, self.check.module] if self.with_cls else mods, stop, ids, torch.ones_like(ids)
            )
            pc = sum(_distance(seen[id(m)], b) for (m, _), b in zip(self.spans, self.bases))
            dc = (
                self.check.distance(seen[id(self.check.module)]).cpu()
                if self.with_cls
                else torch.full((len(ids),), float("inf"))
            )
        assert isinstance(pc, Tensor)
        return pc.cpu(), dc

    def at(self, ids: Tensor, t: int) -> Tensor:
        """Each sentence's cost at position t alone, (N,), through `veil.attacks.span.rowwise`:
        block 1's MLP computes row t only (the attention before it still reads every position),
        and where the sentences agree outside a few columns (a search's candidates for one
        position) its Q/K/V rows are shared and its output projection reads row t alone: a
        fraction of `_scores`' work.
        The shared rows are checked against the plain row on first use (`rows_shared`); falls back
        to `_scores` with more than one block, or where the MLP input keeps every row (a gated
        MLP's other branch broadcasts over the narrowed one)."""
        if len(self.spans) != 1 or self._rowwise is False:
            return self._scores(ids)[0][:, t]
        down = self.spans[0][0]
        self.meter.charge(len(ids), ids.shape[1], ROW_BLOCKS)
        a = block1_row(self.model, ids, t, down, shared=self.rows_shared is not False)
        self._rowwise = a.shape[1] == 1
        if not self._rowwise:
            return self._scores(ids)[0][:, t]
        if self.rows_shared is None:  # first use: the shared rows must give the plain path's rows
            plain = block1_row(self.model, ids, t, down, shared=False)
            self.rows_shared = plain.shape == a.shape and bool(torch.allclose(a, plain, atol=SAME, rtol=SAME))
            a = plain
        return _distance(a[:, 0], self.bases[0]).cpu()


def _distance(x: Tensor, basis: Tensor) -> Tensor:
    """Relative distance of each row of `x` to the span of the orthonormal `basis`, in float32 as
    ``sqrt(1 - |P^T x|^2 / |x|^2)``: one product with the (hidden x rank) basis, half the work of
    float64 (`Span.distance`). Its rounding (~3e-4 near zero) is far below what one wrong token
    adds (>= 1e-2): the search ranks candidates by it, the exact test is `CLSCheck`'s."""
    r = (x @ basis).pow(2).sum(-1) / x.pow(2).sum(-1).clamp_min(1e-30)
    return (1 - r).clamp_min(0).sqrt()
