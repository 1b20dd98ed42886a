"""The walkers of a peeling stage as a member of the search (`veil.attacks.span.strategy`): one
`Walker` per length hypothesis, stepped by fair share of work, and their reseeding rules (the
cross seeds and the extend seeds, `veil.attacks.span.schedule` names which a stage uses).

Fair share: step the hypothesis whose work after this step would be the least (relative to its
merit, `_merit`). Work = tokens scored + CALL_COST per scoring call; a first sweep's is estimated
as n * (candidates of its n positions) + CALL_COST per position, so short hypotheses, cheap to
score, sweep several times before a long one starts. Without a position prior in the objective,
a walker's first sweep starts from the longest sentence a shorter walker has settled on (often
the prefix of a longer one). Ties go to the shorter hypothesis (a fixed order).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from veil.attacks.span.core import Specials, last_position
from veil.attacks.span.options import SpanOptions
from veil.attacks.span.schedule import Member
from veil.attacks.span.score import PositionPrior
from veil.attacks.span.strategy import Proposal, StageView
from veil.attacks.span.walker import CALL_COST, Walker

#: the shortest length hypothesis: [CLS], one token, [SEP]
MIN_LEN = 3


class Walks:
    """A stage's walkers (`length_walkers`) with the work each has used (`used`), the walker steps
    (`rounds`), the cross seeds used (`tried`), and the reseeding rules after a step (`reseed`,
    the first that applies); `merit`: work weighted by each walk's best objective."""

    def __init__(
        self,
        walkers: list[Walker],
        prior: PositionPrior,
        sep: int | None,
        carried: set[int],
        opts: SpanOptions,
        reseed: tuple[Member, ...] = (),
        merit: bool = False,
    ) -> None:
        self.walkers, self.carried, self.opts, self.reseed, self.merit = walkers, carried, opts, reseed, merit
        self.used = [0.0] * len(walkers)
        self.rounds = 0
        self.tried: set[tuple[int, tuple[int, ...]]] = set()
        self.first = [float(w.n * w.sweep_size() + CALL_COST * (len(w.free) + 1)) for w in walkers]
        self.share = _shares(walkers, prior, sep, opts.share_floor)

    @property
    def steps(self) -> int:
        return sum(w.steps for w in self.walkers)

    def begin(self, view: StageView) -> None:
        """Nothing to reset: a stage makes its own walkers."""

    def restart(self, n: int, content: list[int]) -> None:
        """A seed's proposal: the walk of length `n` restarts from `content` (`Walker.restart`)."""
        for w in self.walkers:
            if w.n == n:
                w.restart(content)

    def propose(self, view: StageView, budget: int) -> Proposal:
        """One sweep of the walker with the least work after it (module docstring), never past
        `budget` sentences scored on the stage; its sentence where it passes the exact test, else
        the reseeding rules run."""
        i = self._next()
        w = self.walkers[i]
        if w.sweeps == 0 and view.score.prior is None and w.n not in self.carried:
            shorter = [v for v in self.walkers if v.best is not None and v.n < w.n]
            if shorter:
                w.seed(shorter[-1].best[2][0, 1:-1].tolist())  # type: ignore[index]
        before, had = w.work, w.best
        _, dc, ids = w.step(view.score, budget - view.scored)
        w.last = w.work - before
        self.used[i] += w.last
        self.rounds += 1
        if dc < view.tol:
            return Proposal(hits=[ids[0].tolist()])
        self._reseed(w, had is not w.best)
        return Proposal()

    def _next(self) -> int:
        """The walker whose work after its next sweep, over its merit, is the least (ties: the shorter)."""
        est = [
            (self.used[j] + (w.last if w.last is not None else self.first[j]))
            / _merit(w, self.share[j], self.merit, self.opts.merit_floor)
            for j, w in enumerate(self.walkers)
        ]
        return min(range(len(self.walkers)), key=lambda j: (est[j], j))

    def _reseed(self, w: Walker, new_best: bool) -> None:
        """The first reseeding rule that applies after `w`'s step: the extend seeds on a new lowest
        best, the cross seeds on every `cross_every`-th kick."""
        for rule in self.reseed:
            if rule == Member.EXTEND and new_best and _lowest(w, self.walkers):
                extend_seed(w, self.walkers, self.used, self.opts.extend_lengths)
                return
            if rule == Member.CROSS and w.cur is None and w.kicks % self.opts.cross_every == 0:
                cross_seed(w, self.walkers, self.tried)
                return


def _lowest(w: Walker, walkers: list[Walker]) -> bool:
    """Whether `w`'s best objective per position is the lowest of every length's."""
    assert w.best is not None
    return all(v.best is None or w.best[0] / w.n <= v.best[0] / v.n for v in walkers)


def extend_seed(w: Walker, walkers: list[Walker], used: list[float], offsets: tuple[int, ...]) -> None:
    """A graded walk's new best, the lowest per position of every length, is often a batch
    sentence but for its end: the prefix of a sentence one or two tokens longer, closed early, or
    a sentence with one token too many (e.g. a walk of length n settled on a sentence of n + 1
    tokens without its last one, which no move of its own length reaches). Its content restarts
    the walks of lengths n + `offsets` (default n - 1, n + 1, n + 2; their other positions keep
    their own best tokens), and those run next."""
    assert w.best is not None
    content = w.best[2][0, 1:-1].tolist()
    low = min(used)
    for k, v in enumerate(walkers):
        if v.n - w.n in offsets:
            v.restart(content)
            used[k] = low


def cross_seed(w: Walker, walkers: list[Walker], tried: set[tuple[int, tuple[int, ...]]]) -> bool:
    """Every `cross_every`-th kick of an uncrowded walk: instead of the random kick, start from its
    best sentence overwritten by another length's best content (its prefix, or the whole of a
    shorter one), lowest objective per position first, each source once per length. The trap this
    leaves: a walk of length n settled on the prefix of a longer sentence of the batch (a deep local
    minimum of the layer-2 distance) while the length n - 1 walk holds the true length-n sentence
    but one token; without the cross seed such a walk stays on the longer sentence's prefix."""
    if w.best is None:
        return False
    sources = sorted(
        (v.best[0] / v.n, k, v.best[2][0, 1:-1].tolist())
        for k, v in enumerate(walkers)
        if v is not w and v.best is not None and v.n >= MIN_LEN
    )
    for _, _, content in sources:
        key = (w.n, tuple(content[: w.n - 2]))
        if key in tried:
            continue
        tried.add(key)
        w.x = w.best[2].clone()
        w.seed(content)
        return True
    return False


def best_guesses(walkers: list[Walker]) -> list[list[int]]:
    """The walkers' best sentences, lowest objective per position first, then where a walker has
    none yet (the search stopped before it settled) the sentence it stands at (unsolved sentences' guesses)."""
    scored = [(w.best[0] / w.n, k, w.best[2][0].tolist()) for k, w in enumerate(walkers) if w.best is not None]
    unsettled = [w.x[0].tolist() for w in walkers if w.best is None]
    return [s for _, _, s in sorted(scored, key=lambda x: (x[0], x[1]))] + unsettled


def _merit(w: Walker, share: float, merit: bool, floor: float) -> float:
    """A hypothesis' claim on work: its share, and with `merit` (a crowded span) also the inverse
    of its best objective per position so far (at least `floor`: the true sentence's is well below
    a wrong local minimum's), so the walks closest to a solution run most."""
    if not merit or w.best is None:
        return share
    return share / max(w.best[0] / w.n, floor)


def _shares(walkers: list[Walker], where: PositionPrior, sep: int | None, floor: float) -> list[float]:
    """Work shares of the length hypotheses: `floor` + the position prior's coefficient of [SEP] at
    the hypothesis' last position, so the lengths where the position gradient puts a [SEP] are
    searched first (the true ends get clearly larger coefficients than the other positions)."""
    if where.cost is None or sep is None:
        return [1.0] * len(walkers)
    T = where.cost.shape[0]
    return [floor + (float((1 - where.cost[w.n - 1, sep]).clamp(0, 1)) if w.n - 1 < T else 0.0) for w in walkers]


def length_walkers(
    cands: list[Tensor], specials: Specials, rng: np.random.Generator, opts: SpanOptions
) -> list[Walker]:
    """One walker per length hypothesis n: [SEP] passes layer 1 at n - 1 (or n is the last position
    with candidates), [CLS] at 0, every content position has a candidate."""
    T = last_position(cands)
    if T == 0:
        return []
    sep, cls = specials.sep, specials.cls
    special = {v for v in (sep, cls, specials.pad) if v is not None}
    ends = sorted({t + 1 for t in range(T) if sep is not None and sep in set(cands[t].tolist())} | {T})
    out = []
    for n in ends:
        if n < MIN_LEN:
            continue
        content = [
            torch.tensor([v for v in c.tolist() if v not in special], dtype=torch.long) for c in cands[1 : n - 1]
        ]
        if any(len(c) == 0 for c in content):
            continue
        first = torch.tensor([cls if cls is not None else int(cands[0][0])])
        last = torch.tensor([sep]) if sep is not None else cands[n - 1]
        out.append(Walker([first, *content, last], rng, opts=opts))
    return out
