"""The members of the peeling search (`veil.attacks.span.peel`) and what they share.

A stage searches for one sentence of the batch on the current residual. Its members (the prefix
seeds, `veil.attacks.span.prefix`; the suffix growth, `veil.attacks.span.suffix`; the walkers
with their reseeding rules, `veil.attacks.span.walks`; the pending hits, `Pending`) each
`propose` sentences given a read-only `StageView` of the stage: the sentences that passed the
stage's exact test (`hits`) and the content a length's walk should restart from (`restarts`).
A member keeps what it needs across calls itself; the stage's search loop
(`veil.attacks.span.peel.search_stage`) asks the schedule (`veil.attacks.span.schedule`) which
member runs next, applies the restarts to the walkers, takes the first hit and keeps the others
pending. The LayerNorm pins (`veil.attacks.span.core.pin_positions`) are not a member: they narrow
the layer-1 candidates every member draws from, before a stage starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from veil.attacks.span.options import SpanOptions
from veil.attacks.span.score import Objective, PositionPrior, SentenceScore


@dataclass
class Proposal:
    """What a member's turn produced: sentences that passed the stage's exact test, in the order
    found, and (length, content) restarts for the walkers, in the order to apply them; `spent`: the
    block-row budget ran out during the turn (`WorkSpent`: the restarts before it still apply)."""

    hits: list[list[int]] = field(default_factory=list)
    restarts: list[tuple[int, list[int]]] = field(default_factory=list)
    spent: bool = False


class StageView(Protocol):
    """What a member may read of a stage (`veil.attacks.span.peel.Stage`); nothing to write."""

    @property
    def cands(self) -> list[Tensor]: ...  # the layer-1 candidates per position

    @property
    def prior(self) -> PositionPrior: ...

    @property
    def score(self) -> SentenceScore: ...  # the objective's scorer (its exact test: `score.cls`)

    @property
    def objective(self) -> Objective: ...

    @property
    def lengths(self) -> list[int]: ...  # the length hypotheses, shortest first (one walker each)

    @property
    def left(self) -> int: ...  # sentences left in the residual

    @property
    def tol(self) -> float: ...  # the exact test's tolerance

    @property
    def gate(self) -> float: ...  # the prefix seeds' layer-2 gate before the exact test

    @property
    def opts(self) -> SpanOptions: ...

    @property
    def scored(self) -> int: ...  # sentences scored on this stage, every member together


class Strategy(Protocol):
    """A member of the search: `propose` scores sentences (never past `budget` sentences scored on
    the stage, `StageView.scored`) and returns what it found; `steps` counts the sentences it
    scored on the current stage (`begin` starts a stage)."""

    @property
    def steps(self) -> int: ...

    def begin(self, view: StageView) -> None: ...

    def propose(self, view: StageView, budget: int) -> Proposal: ...


class Pending:
    """Exact sentences a stage found beside the one it peeled: each stage re-tests them on its own
    residual, in the order found, before anything else (a test is not counted as scored)."""

    def __init__(self) -> None:
        self.queue: list[list[int]] = []
        self.steps = 0

    def begin(self, view: StageView) -> None:
        """Nothing to reset: the queue is the search's."""

    def propose(self, view: StageView, budget: int) -> Proposal:
        """The first queued sentence that still passes the exact test (each tested one leaves the queue)."""
        for sent in list(self.queue):
            self.queue.remove(sent)
            if view.score.cls(torch.tensor([sent])) < view.tol:
                return Proposal(hits=[sent])
        return Proposal()

    def keep(self, hits: list[list[int]]) -> None:
        """Queue exact sentences found beside the one a stage takes."""
        self.queue.extend(hits)
