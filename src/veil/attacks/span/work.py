"""The peeling search's second budget (`veil.attacks.span.peel`): counted block-row evaluations.

The first budget counts candidate sentences scored, but one scored sentence costs anything from a
fifth of one block over its tokens (a single row scored through `veil.attacks.span.rowwise`) to
every block forward and backward (the crowded objective's embedding-gradient match). A budget in
sentences therefore does not bound the time a search takes. This one counts what a scoring call
computes: one block-row is one token through one transformer block, a backward pass counts as two
forward passes, and each call adds `CALL_ROWS` for its fixed cost. The count follows the
arithmetic of a call, not a clock, so a search stops at the same point on any machine and under
any load; the seconds one block-row takes grow with the model's width (about as width squared).

Every scorer charges its `Meter` before computing; a call that would pass the limit raises
`WorkSpent` instead, which the peeling search catches to return its best guesses.
"""

from __future__ import annotations

from dataclasses import dataclass

#: the default block-row budget of a peeling search per sentence of the batch (`SpanOptions.work`):
#: a batch of 4 on MiniLM (width 384) in a few minutes of two CPU cores
WORK = 400_000

#: block-rows charged per scoring call beyond its tokens: a call's fixed cost (hooks, the
#: framework's dispatch, the span projections' setup) in the unit of one token through one block
CALL_ROWS = 64


class WorkSpent(Exception):
    """The next scoring call would pass the search's block-row budget."""


@dataclass
class Meter:
    """Block-rows computed so far (`done`) against `limit` (None: unbounded); `stopped` is set
    once a call was refused."""

    limit: int | None = None
    done: int = 0
    stopped: bool = False

    def charge(self, sentences: int, length: int, blocks: float) -> None:
        """Account for one scoring call of `sentences` sentences of `length` tokens through
        `blocks` block-equivalents each; raises `WorkSpent` (charging nothing) where it would
        pass the limit."""
        units = int(round(sentences * length * blocks)) + CALL_ROWS
        if self.limit is not None and self.done + units > self.limit:
            self.stopped = True
            raise WorkSpent
        self.done += units
