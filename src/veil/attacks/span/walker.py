"""Peeling's local search for one sentence of a fixed length (`veil.attacks.span.peel`): coordinate
descent over each position's candidates and swaps, kicks from the best local minimum.

Deterministic at any thread count. The objectives are float32 sums whose last bits change with
the number of threads and with the batch a sentence is scored in (a candidate batch holds the
current sentence itself, re-scored), and so do the observed gradients they are computed from.
With an absolute margin, whether such a rescore "improves" on the current value is a coin toss
that changes the walk. So every comparison has a margin relative to float32's precision
(`IMPROVE`: a move improves on f only below f - IMPROVE * max(|f|, 1)) and among candidates within
that margin of the best the first in a fixed order wins (`pick`); token rankings sort stably.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from veil.attacks.span.options import DEFAULTS, SpanOptions
from veil.attacks.span.score import PositionPrior, SentenceScore

#: what one scoring call costs beyond its tokens, in token evaluations: a call's fixed cost is
#: that of scoring a long run of tokens with the gradient match
CALL_COST = 150
#: relative margin of every objective comparison: 2**10 float32 ulps (~1.2e-4), far above the
#: rounding of a float32 sum over a sentence, far below a real move's change (one wrong token: >= 1e-2)
IMPROVE = 1024 * float(torch.finfo(torch.float32).eps)
#: candidate sentences per scoring call as the work counts them (`Walker.work`: one `CALL_COST`
#: per call of this many): an accounting unit and a memory bound, not a tunable of the search
CHUNK = 2048


def margin(f: float) -> float:
    """The least decrease of objective `f` that counts as an improvement."""
    return IMPROVE * max(abs(f), 1.0)


def pick(f: Tensor, current: float) -> int | None:
    """Index of the best candidate of `f` that improves on `current` by more than its margin, the
    first in order among those within the margin of the least; None when none improves."""
    best = float(f.min()) if len(f) else float("inf")
    if not best < current - margin(current):
        return None
    return int(torch.nonzero(f <= best + margin(best)).flatten()[0])


class Walker:
    """Iterated local search for one sentence of a fixed length on the summed per-position cost
    plus ``cls_weight`` x the [CLS] distance: coordinate descent over each position's candidates
    and swaps of two positions' tokens (the typical trap: two tokens that pass layer 1 at each
    other's position, exchanged) until neither helps, then a random kick of `kick` positions
    (drawn in proportion to their cost) from the best sentence found. `step` runs one sweep, so
    the caller can interleave many walkers finely.

    With ``narrow = k`` (and a position prior, `start_at`) a sweep first tries only each position's
    k best tokens by the prior (and swaps between them): the once-only tokens of a batch rank in
    its top few at their own position, a repeated one mostly in the top 8. Where such a sweep helps no more, the sentence is
    checked, then the next sweep tries every candidate; only where that one does not help either
    is it a local minimum (kick). The neighbourhood of a local minimum is thus unchanged; the
    sweeps on the way there cost k instead of every candidate per position."""

    def __init__(
        self,
        sets: list[Tensor],
        rng: np.random.Generator,
        kick: int | None = None,
        chunk: int = CHUNK,
        *,
        opts: SpanOptions = DEFAULTS,
    ) -> None:
        """`sets`: each position's allowed tokens; `kick` (unset: ``opts.kick``) and the kicks'
        draws from the position prior (``opts.kick_prior``, ``opts.kick_top``) come from `opts`."""
        self.sets, self.rng, self.chunk = sets, rng, chunk
        self.kick = opts.kick if kick is None else kick
        self.kick_prior, self.kick_top = opts.kick_prior, opts.kick_top
        self.n = len(sets)
        self.allowed = [set(s.tolist()) for s in sets]
        self.free = [t for t, s in enumerate(sets) if len(s) > 1]
        self.x = self.random()
        self.ranked: dict[int, Tensor] | None = None  # per free position, its tokens by prior cost (`start_at`)
        self.cur: tuple[float, float] | None = None  # (objective, cls distance) of x; None: not scored yet
        self.best: tuple[float, float, Tensor] | None = None  # the best local minimum: (objective, cls distance, ids)
        self.steps = 0  # sentences scored
        self.work = 0.0  # their cost in token evaluations, CALL_COST per scoring call included
        self.sweeps = 0
        self.last: float | None = None  # work of the last sweep
        self.narrow: int | None = None  # sweeps try each position's `narrow` best tokens by the prior first
        self._wide = False  # the next sweep tries every candidate (a narrow sweep stalled)
        self.stopped = False  # a step's `limit` ran out inside its sweep
        self.kicks = 0  # local minima left by a kick
        self._until: int | None = None  # `steps` at which the current step's limit runs out (None: no limit)

    def random(self) -> Tensor:
        return torch.tensor([[int(s[self.rng.integers(len(s))]) for s in self.sets]])

    def _draw(self, t: int) -> int:
        """A token for a kicked position: with probability `kick_prior` one of the `kick_top` best by
        the position prior, else any allowed one."""
        s = self.sets[t]
        if self.ranked is not None and self.rng.random() < self.kick_prior:
            top = self.ranked[t][: self.kick_top]
            return int(top[self.rng.integers(len(top))])
        return int(s[self.rng.integers(len(s))])

    def start_at(self, prior: PositionPrior) -> None:
        """Start every free position at its allowed token of lowest prior cost; kicks then favour
        the prior's best tokens (`_draw`)."""
        if prior.cost is None:
            return
        self.ranked = {
            t: self.sets[t][prior.cost[t, self.sets[t]].argsort(stable=True)]
            if t < prior.cost.shape[0]
            else self.sets[t]
            for t in self.free
        }
        for t in self.free:
            v = prior.best(t, self.sets[t])
            if v is not None:
                self.x[0, t] = v

    def seed(self, prefix: list[int]) -> None:
        """Start from `prefix` (content tokens from position 1 on, where allowed) instead of at random."""
        for t, v in enumerate(prefix[: self.n - 2], start=1):
            if v in self.allowed[t]:
                self.x[0, t] = v

    def restart(self, content: list[int]) -> None:
        """Leave the current walk: from the best sentence (or the current one) with `content`
        written over it from position 1 (`seed`), scored afresh, its next sweeps as a new walk's."""
        self.x = (self.best[2] if self.best is not None else self.x).clone()
        self.seed(content)
        self.cur, self._wide = None, False

    def _objective(self, score: SentenceScore, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        fs, dcs, pcs = [], [], []
        rows = min(self.chunk, score.rows_per_call(self.n))  # what fits in memory; the work counts `chunk`
        for i in range(0, len(x), rows):
            pc, dc = score(x[i : i + rows])
            fs.append(pc.sum(1) + (score.cls_weight * dc if score.with_cls else 0))
            dcs.append(dc)
            pcs.append(pc)
        self.steps += len(x)
        self.work += len(x) * self.n + CALL_COST * -(-len(x) // self.chunk)
        return torch.cat(fs), torch.cat(dcs), torch.cat(pcs)

    def _narrowed(self) -> bool:
        return self.narrow is not None and self.ranked is not None and not self._wide

    def _moves(self, t: int) -> Tensor:
        """The tokens the current sweep tries at position t."""
        return self.ranked[t][: self.narrow] if self._narrowed() else self.sets[t]  # type: ignore[index]

    def sweep_size(self) -> int:
        """Candidate tokens the next sweep tries over all positions (its cost estimate)."""
        return sum(len(self._moves(t)) for t in self.free) + self.n - len(self.free)

    def _swaps(self) -> Tensor:
        x = self.x[0].tolist()
        allowed = (
            [set(self._moves(t).tolist()) if t in self.free else self.allowed[t] for t in range(self.n)]
            if self._narrowed()
            else self.allowed
        )
        pairs = [
            (i, j)
            for a, i in enumerate(self.free)
            for j in self.free[a + 1 :]
            if x[i] != x[j] and x[j] in allowed[i] and x[i] in allowed[j]
        ]
        var = self.x.repeat(len(pairs), 1)
        for r, (i, j) in enumerate(pairs):
            var[r, i], var[r, j] = x[j], x[i]
        return var

    def _move_to_best(self, score: SentenceScore, var: Tensor) -> bool:
        """Score the candidate sentences `var` and move to the best one where it beats the current
        sentence (`pick`); True when it moved."""
        assert self.cur is not None
        f, dc, pc = self._objective(score, var)
        j = pick(f, self.cur[0])
        if j is None:
            return False
        self.x, self.cur, self._pc = var[j : j + 1].clone(), (float(f[j]), float(dc[j])), pc[j : j + 1]
        return True

    def step(self, score: SentenceScore, limit: int | None = None) -> tuple[float, float, Tensor]:
        """One sweep (every position, then the swaps); at a local minimum the next step kicks.
        Returns (objective, [CLS] distance, ids) of the current sentence (the [CLS] distance is
        only computed at local minima when the objective does not include it).

        `limit` caps the sentences this step scores: each scoring call takes at most what is left
        of it (the first candidates in the sweep's fixed order), and where nothing is left the sweep
        ends there (`stopped`; the current sentence becomes `best` if it is better), so a caller's
        budget is met exactly."""
        self._until = None if limit is None else self.steps + limit
        if self.cur is None:
            if self._spent():
                self.stopped = True
                return (float("inf"), float("inf"), self.x.clone())
            f, dc, self._pc = self._objective(score, self.x)
            self.cur = (float(f[0]), float(dc[0]))
        moved = self._position_pass(score)
        swapped = None if moved is None else self._swap_pass(score)
        if moved is None or swapped is None:
            return self._stop()
        self.sweeps += 1
        return self._settle(score, moved or swapped)

    def _room(self, n: int) -> int:
        """Of n candidates, how many this step may still score."""
        return n if self._until is None else max(0, min(n, self._until - self.steps))

    def _spent(self) -> bool:
        return self._until is not None and self.steps >= self._until

    def _position_pass(self, score: SentenceScore) -> bool | None:
        """Coordinate descent over the free positions in a random order: whether it moved, None
        where the step's limit ran out first."""
        improved = False
        for t in self.rng.permutation(self.free).tolist():
            moves = self._moves(t)
            if self._spent():
                return None
            var = self.x.repeat(len(moves), 1)
            var[:, t] = moves
            improved = self._move_to_best(score, var[: self._room(len(var))]) or improved
        return improved

    def _swap_pass(self, score: SentenceScore) -> bool | None:
        """The best swap of two positions' tokens: whether it moved, None where the step's limit
        ran out before every swap was tried (then it is not a sweep)."""
        var = self._swaps()
        if not len(var):
            return False
        if self._spent():
            return None
        cut = self._room(len(var)) < len(var)
        moved = self._move_to_best(score, var[: self._room(len(var))])
        return None if cut else moved

    def _settle(self, score: SentenceScore, improved: bool) -> tuple[float, float, Tensor]:
        """After a whole sweep: go on where it moved; a narrow sweep that did not move widens; a
        wide one that did not move is a local minimum, kept if best, then kicked (`_kick`)."""
        assert self.cur is not None
        out = (self.cur[0], self.cur[1], self.x.clone())
        if improved:
            self._wide = False
            return out
        if not score.with_cls:  # a (narrow or true) local minimum: check it
            out = (out[0], score.cls(self.x), out[2])
        if self._narrowed():  # the prior's tokens help no more: next, every candidate (no kick)
            self._wide = True
            return out
        self._wide = False
        if self.best is None or out[0] < self.best[0] - margin(self.best[0]):
            self.best = out
            self._best_pc = self._pc
        self._kick()
        return out

    def _kick(self) -> None:
        """Restart from the best local minimum with `kick` positions redrawn (`_draw`), chosen in
        proportion to their per-position cost there."""
        assert self.best is not None
        self.x = self.best[2].clone()
        if self.free:
            w = self._best_pc[0, self.free].double().numpy() + 1e-12  # no position's chance exactly 0
            for t in self.rng.choice(
                self.free, size=min(self.kick, len(self.free)), replace=False, p=w / w.sum()
            ).tolist():
                self.x[0, t] = self._draw(t)
        self.cur = None
        self.kicks += 1

    def hold(self) -> None:
        """The search stopped between or inside this walker's calls: keep its current sentence as
        the best guess if it is better than the best local minimum (as `_stop`)."""
        if self.cur is not None:
            self._stop()

    def _stop(self) -> tuple[float, float, Tensor]:
        """The budget ran out inside a sweep: keep the current sentence as the best guess if it is
        better than the best local minimum (no kick, the sweep is not counted)."""
        self.stopped = True
        assert self.cur is not None
        if self.best is None or self.cur[0] < self.best[0] - margin(self.best[0]):
            self.best = (self.cur[0], self.cur[1], self.x.clone())
            self._best_pc = self._pc
        return (self.cur[0], self.cur[1], self.x.clone())
