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

`usable` is False otherwise (no gap). `RowCheck` then tests a sentence at any B*T by its
token-embedding gradient rows: the embeddings are added before anything else, so row v of the
token table's gradient is ``(1/B) sum`` over the occurrences of v of ``dl_b/dx_{b,t}``, the gradient
of sentence b's own loss at its token embedding. For a token v that occurs in one sentence s only
(most content tokens of a batch), that row is ``(1/B) sum_{t: s_t = v} dl(s, y)/dx_t``, which the
attacker recomputes from a candidate sentence and label (one backward pass for both labels of a
binary task). Every token's gradient depends on the whole sentence through every block, so the true
sentence matches such a row to float rounding and a sentence with one token wrong misses every row
by orders of magnitude more. The test needs one such token in the sentence; repeated tokens become
single as peeling subtracts the sentences found.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from veil.attacks.span.core import Span, model_device
from veil.attacks.span.options import DEFAULTS, SpanOptions
from veil.models.base import VeilModel

if TYPE_CHECKING:
    from veil.attacks.span.residual import Residual

#: relative singular value above which a direction of the last block's Q gradient counts toward its
#: rank: float64 SVD of a float32 gradient, whose rounding sits orders of magnitude below it
RANK_GAP = 1e-5

#: `row_span`'s spectrum cut: drops searched only below this relative singular value (the float32
#: noise floor of a gradient sits just below its weakest real directions), and only a drop of at
#: least `MIN_DROP` x counts as the floor
REGION = 1e-4
MIN_DROP = 3.0


def row_span(
    g: Tensor, k: int | None = None, tol: float = DEFAULTS.rank_tol, region: float = REGION, min_drop: float = MIN_DROP
) -> Span:
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

    def __init__(
        self,
        res: Residual,
        rank_gap: float = RANK_GAP,
        max_fill: float = DEFAULTS.cls_fill,
        tol: float = DEFAULTS.tol_cls,
    ) -> None:
        model = res.model
        self.module = model.attention_layers()[-1].q
        k = res.left
        g = res.weight_grad(self.module)
        s = torch.linalg.svdvals(g.double())
        cls_only = k >= 1 and not (k < len(s) and s[k] > rank_gap * s[0])  # rank <= B: a [CLS]-only layer
        self.rows = "cls" if cls_only else "all"
        self.span = row_span(g, k=k) if cls_only else row_span(g)
        self.usable = k >= 1 and (cls_only or 0 < self.span.rank <= max_fill * self.span.width)
        self.tol = tol

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


def label_grads(model: VeilModel, ids: Tensor) -> list[Tensor]:
    """Per label y, ``dl(s, y)/dx_t`` at every token embedding of sentences `ids` (N, T), each
    (N, T, width): a binary head needs one backward pass, ``(p_1 - y) d(logit_1 - logit_0)/dx``."""
    ids = ids.to(model_device(model))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    with torch.enable_grad():
        tok = model.token_embedding().weight.detach()[ids].requires_grad_(True)
        logits = model.forward_from_embeddings(model.assemble(tok, model.position_embeddings(tok), batch), batch)
        C = logits.shape[-1]
        if C == 2:
            (jac,) = torch.autograd.grad((logits[:, 1] - logits[:, 0]).sum(), tok)
            p1 = logits.detach().softmax(-1)[:, 1]
            return [(p1 - y)[:, None, None] * jac for y in range(2)]
        return [
            torch.autograd.grad(
                nn.functional.cross_entropy(logits, torch.full((len(ids),), y, device=ids.device), reduction="sum"),
                tok,
                retain_graph=y < C - 1,
            )[0]
            for y in range(C)
        ]


class RowCheck:
    """The exact sentence test of the module docstring read off the residual token-embedding
    gradient, at any B*T: a sentence is in the batch iff, with one of the labels, one of its
    tokens' rows matches the sentence's own recomputed row within `tol` (relative). `usable`
    where the token table's gradient is exported and a sentence is left."""

    rows = "grad"

    def __init__(self, res: Residual, tol: float = DEFAULTS.tol_row) -> None:
        g = res.token_grad()
        self.target = g.float() if g is not None else None
        self.batch_size = res.batch_size
        self.module = res.model.attention_layers()[-1].q
        self.usable = self.target is not None and res.left >= 1
        self.tol = tol

    def from_grads(self, ids: Tensor, grads: list[Tensor]) -> Tensor:
        """(N,) the test's distance from the per-label embedding gradients of `label_grads`: the
        smallest relative mismatch of a token's row, the best label's."""
        assert self.target is not None
        ids = ids.to(grads[0].device)
        same = (ids[:, :, None] == ids[:, None, :]).to(grads[0].dtype)  # a token's occurrences in its sentence
        target = self.target.to(grads[0].device)[ids]
        tnorm = target.norm(dim=-1).clamp_min(1e-30)
        miss = [((target - same @ g / self.batch_size).norm(dim=-1) / tnorm).amin(1) for g in grads]
        return torch.stack(miss).amin(0).detach().cpu()

    def sentences(self, model: VeilModel, ids: Tensor) -> Tensor:
        """(N,) the test's distance of sentences `ids`, from one backward pass per label."""
        return self.from_grads(ids, label_grads(model, ids))

    def rows_missed(self, ids: list[int], sentence_rows: Tensor) -> float:
        """The smallest relative mismatch between the residual rows of the tokens of `ids` and a
        sentence's own token-table gradient (/ B) `sentence_rows`: ~0 for its true label."""
        assert self.target is not None
        rows = torch.tensor(sorted(set(ids)), device=sentence_rows.device)
        target = self.target.to(sentence_rows.device)[rows].double()
        miss = (target - sentence_rows[rows].double()).norm(dim=1) / target.norm(dim=1).clamp_min(1e-30)
        return float(miss.min())


def exact_check(res: Residual, opts: SpanOptions) -> CLSCheck | RowCheck:
    """The residual's exact test: the last block's span where it leaves a gap (a forward pass per
    candidate), else the embedding rows (a backward pass too); check `.usable`."""
    check = CLSCheck(res, max_fill=opts.cls_fill)
    check.tol = opts.tol_cls if check.rows == "cls" else opts.tol_all
    if check.usable or not opts.row_check:
        return check
    return RowCheck(res, tol=opts.tol_row)
