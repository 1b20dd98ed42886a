"""What peeling's search minimises (`veil.attacks.span.peel`): a candidate sentence's per-position
cost (the layer-2 span distance, plus the token-embedding-gradient mismatch) and its distance to
the last block's span (`CLSCheck`), and the position prior read off the two embedding gradients.
"""

from __future__ import annotations

from enum import StrEnum

import torch
from torch import Tensor, nn

from veil.attacks.span.checks import CLSCheck, RowCheck, label_grads
from veil.attacks.span.core import ACT_FLOATS, Span, model_device, recording_inputs, rows_per_call
from veil.attacks.span.options import DEFAULTS
from veil.attacks.span.residual import Residual
from veil.attacks.span.rowwise import block1_row
from veil.attacks.span.work import Meter
from veil.models.base import VeilModel


class Objective(StrEnum):
    """What a stage's walkers descend on: the layer-2 span distance (`SentenceScore`), the MLP
    down-projection spans below their rank limit (`MLPScore`: exact) or at it (graded)."""

    LAYER2 = "layer2"
    MLP = "mlp"
    MLP_GRADED = "mlp-graded"


#: block-equivalents per token of one row scored through `veil.attacks.span.rowwise` (block 1's
#: attention over the varied columns, its MLP on one row): about a fifth of block 1 over every token
ROW_BLOCKS = 0.25

#: tolerances of the one-row self-check (`SentenceScore.at`): float32 rounding of the same row
#: computed alone and in the full pass, far below what a wrong row would differ by
ROW_ATOL, ROW_RTOL = 1e-4, 1e-3

#: a token-table gradient row is in the bag above this fraction of the largest row: peeled rows
#: leave ~1e-7 of float32 residue
BAG_FLOOR = 1e-4

#: prior costs this close count as a tie (float32 least squares; the first in order wins)
TIE = 1e-4


def _probe(model: VeilModel, mods: list[nn.Module], stop: nn.Module, ids: Tensor, mask: Tensor) -> dict[int, Tensor]:
    """The inputs of `mods` for sentences `ids`, stopping the forward pass at `stop`'s input."""
    dev = model_device(model)
    with recording_inputs(mods, stop=stop) as seen:
        model({"input_ids": ids.to(dev), "attention_mask": mask.to(dev)})
    return seen


class SentenceScore:
    """Scores of equal-length candidate sentences: a per-position cost (N, T) and the [CLS] distance (N,).

    The per-position cost is the layer-2 span distance, plus, with ``tok_grad`` (the residual
    token-embedding gradient), the embedding-gradient mismatch: a token v that occurs once in the
    (remaining) batch has ``dL/dE[v] = (1/B) dl_b/dx_{b,t}``, the gradient of its own sentence's loss
    at its one position, which the attacker recomputes for a candidate sentence (one backward pass
    per label, the best label kept). With the rest of the sentence even half wrong, a right token
    matches its row closely and a wrong one misses by far more: a per-position test that, unlike the spans, does not need B*T < width. Tokens
    that occur several times get a capped cost (`cap`) wherever they are put.

    ``with_cls=False`` stops the forward pass at layer 2 (the [CLS] distance is then +inf): the
    search objective when the layer-2 span leaves room (codimension >= width / 8), where layer 2
    alone pins every position; `cls` scores the candidates the search settles on."""

    def __init__(
        self,
        model: VeilModel,
        span2: Span,
        check: CLSCheck | RowCheck,
        with_cls: bool = True,
        cls_weight: float = DEFAULTS.cls_weight,
        tok_grad: Tensor | None = None,
        batch_size: int = 1,
        cap: float = DEFAULTS.grad_cap,
        prior: PositionPrior | None = None,
    ) -> None:
        self.model, self.span2, self.check, self.with_cls, self.cls_weight = model, span2, check, with_cls, cls_weight
        self.prior = prior
        self.q2 = model.attention_layers()[1].q
        self.tok_grad = tok_grad.float() if tok_grad is not None and with_cls else None
        self.batch_size, self.cap = batch_size, cap
        self.row_ok: bool | None = None  # whether `at` gives `_scores`' column (None: not tried yet)
        self.meter = Meter()  # the block-rows scored (`veil.attacks.span.work`); the search sets its own
        self.depth = len(model.attention_layers())

    def rows_per_call(self, n: int) -> int:
        """Candidate sentences of `n` tokens one scoring call may hold: its activations (all blocks
        and their backward pass with the gradient match, else the first two blocks) within
        `CALL_BYTES` on the CPU, a quarter of the free memory on a GPU."""
        layers = len(self.model.attention_layers()) if self.tok_grad is not None or self.with_cls else 2
        per = n * self.span2.width * layers * (ACT_FLOATS * (3 if self.tok_grad is not None else 1)) * 4
        return rows_per_call(self.model, per)

    def __call__(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        pc, dc = self._scores(ids)
        return (pc + self.prior(ids) if self.prior is not None else pc), dc

    def _scores(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        # blocks run per token: every block forward and backward with the gradient match, every
        # block forward with the [CLS] distance, else block 1 (layer 2's input)
        blocks = 3 * self.depth if self.tok_grad is not None else self.depth if self.with_cls else 1
        self.meter.charge(len(ids), ids.shape[1], blocks)
        if self.tok_grad is not None:
            return self._with_gradient(ids)
        mods = [self.q2, self.check.module] if self.with_cls else [self.q2]
        with torch.no_grad():
            seen = _probe(self.model, mods, mods[-1], ids, torch.ones_like(ids))
            d2 = self.span2.distance(seen[id(self.q2)].double()).float().cpu()
            dc = (
                self.check.distance(seen[id(self.check.module)]).cpu()
                if self.with_cls
                else torch.full((len(ids),), float("inf"))
            )
        return d2, dc

    def at(self, ids: Tensor, t: int) -> Tensor:
        """Each sentence's cost at position t alone, (N,): layer 2's input at row t is block 1's
        output there, so block 1 computes that row only (`veil.attacks.span.rowwise`; checked
        against `_scores`' column on first use, `row_ok`). The [CLS] distance and the gradient
        match need every position: with either, the full column."""
        if self.tok_grad is not None or self.with_cls or self.row_ok is False:
            return self(ids)[0][:, t]
        self.meter.charge(len(ids), ids.shape[1], ROW_BLOCKS)
        x = block1_row(self.model, ids, t, self.q2, shared=True)
        c = self.span2.distance(x[:, t if x.shape[1] > t else 0].double()).float().cpu()
        if self.prior is not None:
            c = c + self.prior(ids)[:, t]
        if self.row_ok is None:
            full = self(ids)[0][:, t]
            self.row_ok = bool(torch.allclose(c, full, atol=ROW_ATOL, rtol=ROW_RTOL))
            c = full
        return c

    def _with_gradient(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        ids = ids.to(model_device(self.model))
        assert self.tok_grad is not None
        row_test = isinstance(self.check, RowCheck)  # reads the gradients, not the last block's inputs
        with recording_inputs([self.q2] if row_test else [self.q2, self.check.module]) as seen:
            grads = label_grads(self.model, ids)
        target = self.tok_grad[ids]  # (N, T, D)
        tnorm = target.norm(dim=-1).clamp_min(1e-30)
        best: Tensor | None = None
        for g in grads:
            e = ((g / self.batch_size - target).norm(dim=-1) / tnorm).clamp_max(self.cap).detach()
            best = e if best is None else torch.where((e.sum(1) < best.sum(1))[:, None], e, best)
        d2 = self.span2.distance(seen[id(self.q2)].double()).float()
        dc = self.check.from_grads(ids, grads) if row_test else self.check.distance(seen[id(self.check.module)])
        assert best is not None
        return (d2 + best).cpu(), dc.cpu()

    def cls(self, ids: Tensor) -> float:
        """The largest exact-test distance of sentences `ids`: to the last block's span
        (`CLSCheck`), or of their embedding rows (`RowCheck`, a backward pass too)."""
        if isinstance(self.check, RowCheck):
            self.meter.charge(len(ids), ids.shape[1], 3 * self.depth)
            return float(self.check.sentences(self.model, ids).max())
        self.meter.charge(len(ids), ids.shape[1], self.depth)
        with torch.no_grad():
            z = _probe(self.model, [self.check.module], self.check.module, ids, torch.ones_like(ids))[
                id(self.check.module)
            ]
        return float(self.check.distance(z).max())


class PositionPrior:
    """Where each batch token sits, from the two embedding gradients (any B*T).

    The token and position embeddings are added before anything else, so with ``u_{b,t}`` the
    gradient of the loss at the summed embedding of token (b, t): row v of the token table's
    gradient is ``sum of u over the occurrences of v`` and row t of the position table's gradient
    is ``sum_b u_{b,t}`` (padding gets none). A token that occurs once is one ``u``, so position
    row t is (close to) the sum of the rows of the tokens that sit at t: least squares of each
    position row on the bag's token rows gives coefficients ~1 for them and ~0 for the rest
    (a repeated token's occurrences are not in that basis one by one, which blurs the fit: most
    true pairs get >= 0.5, against a few of the bag's other tokens per position). Every walk
    starts at the best token of each position and its
    kicks favour the best three (`Walker.start_at`). Only while the layer-2 span is crowded (its
    objective is already soft there) is ``weight * (1 - clamp(c_{t,v}, 0, 1))`` added to each
    position's cost: with a clear layer-2 gap the true sentence is the exact zero of that
    objective, and the prior's cost on repeated tokens would move its minimum off it.
    """

    def __init__(self, res: Residual, length: int, weight: float = DEFAULTS.prior_weight) -> None:
        self.weight = weight
        self.cost: Tensor | None = None
        G, P = res.token_grad(), res.position_grad()
        if G is None or P is None or weight <= 0:
            return
        G, P = G.cpu(), P.cpu()  # a small least-squares fit: on the CPU, where the searches read it
        norms = G.norm(dim=1)
        bag = torch.nonzero(norms > BAG_FLOOR * float(norms.max())).flatten()
        if not len(bag):
            return
        T = min(length, P.shape[0])
        C = torch.linalg.lstsq(G[bag].T, P[:T].T).solution.T  # (T, V): position row t ~ C[t] @ G[bag]
        cost = torch.ones(T, G.shape[0], dtype=torch.float32)
        cost[:, bag] = (1 - C.clamp(0, 1)).float()
        self.cost = cost

    def __call__(self, ids: Tensor) -> Tensor:
        """(N, n) prior cost of each token at its position (zeros when there is no prior)."""
        if self.cost is None:
            return torch.zeros(ids.shape, dtype=torch.float32)
        n = min(ids.shape[1], self.cost.shape[0])
        out = torch.ones(ids.shape, dtype=torch.float32)
        out[:, :n] = self.cost[torch.arange(n), ids[:, :n]]
        return self.weight * out

    def best(self, t: int, allowed: Tensor) -> int | None:
        """The allowed token with the lowest prior cost at position t (None without a prior)."""
        if self.cost is None or t >= self.cost.shape[0]:
            return None
        c = self.cost[t, allowed]
        return int(allowed[int(torch.nonzero(c <= c.min() + TIE).flatten()[0])])  # near-ties: the first in order
