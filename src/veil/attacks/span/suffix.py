"""Peeling's right-to-left seeds for a bidirectional encoder past layer 2's reach
(`veil.attacks.span.peel`, on the MLP objective of `veil.attacks.span.mlp`; DAGER's span test,
Petrov et al. 2024 eq. 2-3, applied to the block-1 MLP down-projection).

Where the batch holds about as many tokens as the width, the MLP span is at its rank limit and the
objective is graded; walkers then settle on chimeras and on prefixes of longer sentences. What the
objective still says clearly is local: a position's block-1 MLP input depends on its own token
and on the token before it far more than on the rest (one of a pretrained encoder's first-layer
heads reads the previous token; `benchmarks/span_landscape.py --locality` measures it). So given a
sentence's true suffix from t + 1 on, the token at t is the one that makes position t + 1's cost
lowest, a sharper ranking than its own position's cost, which the unknown left context blurs
(what growing left to right, `veil.attacks.span.prefix`, ranks by).

`suffix_seed` grows, for every length hypothesis n, one sentence from its end: [SEP] at n - 1,
then positions n - 2 down to 1, each the content candidate with the lowest cost at the position
after it (`MLPScore.at`: only that row goes through the MLP), and checks every grown sentence
with the exact [CLS] test; the lengths that fail restart their walkers from what was grown.
A wrong step comes from the filler left of the suffix, not from the objective, and sends the
growth along another sentence; one pass never goes back. So the grown sentence is swept again
from its end with itself as the context (`SuffixSeeder.grow`, at most `SWEEPS`, only positions
within `REACH` of a change, until it passes the exact test or stops changing). The sweeps run
only where the model's block 1 reads the token before each position (`reads_previous`). When a
search grows first is `Growth`'s rule. What a pass misses: it grows one sentence per length, so
of several sentences of the same length at most one is found per pass. Figures: docs/results.md
(span-scale) and docs/span.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from veil.attacks.span.core import Specials
from veil.attacks.span.score import Objective
from veil.attacks.span.walker import IMPROVE

#: right-to-left sweeps per grown sentence at most, the first from the prior's filler (`SuffixSeeder.grow`)
SWEEPS = 6

#: a changed token sends the positions this close to it through the next sweep again
REACH = 2

#: how much more a position's cost must move with the token before it than with one three before
LOCAL = 2.5

#: how close to its rank limit an exact MLP span has the growth run first (`Growth.first`)
NEAR = 0.85

if TYPE_CHECKING:
    from veil.attacks.span.peel import Stage


@dataclass
class Growth:
    """A peeling search's use of the right-to-left seeds: whether they run at all, whether the
    search has met the graded MLP objective (`past`: the batch began at the MLP span's rank limit),
    and whether the model's block 1 reads the token before each position (`reads_previous`,
    tested on the search's first growth: the repair sweeps run only then)."""

    on: bool = True
    past: bool = False
    reads_previous: bool | None = None  # the model's block 1 reads the token before (`reads_previous`)

    def first(self, objective: Objective, fill: float = 0.0) -> bool:
        """Grow before the prefix seeds: on the graded MLP objective, on every MLP stage of a search
        that began there, and on an exact one whose span is within `NEAR` of its rank limit
        (`fill`: rank / limit). Near the limit the first prefix seeds to succeed decide which
        sentences are left, and the growth finds sentences the seeds then cannot; well below it
        the prefix seeds are cheaper and run first."""
        self.past = self.past or objective == Objective.MLP_GRADED
        return self.on and objective in (Objective.MLP, Objective.MLP_GRADED) and (self.past or fill >= NEAR)

    def then(self, objective: Objective) -> bool:
        """Grow after prefix seeds that found nothing (before the walkers), on any objective: the
        layer-2 input reads the token before it through block 1's attention as the MLP's does.
        After prefix seeds that found nothing, the growth costs less than the walkers for the next
        sentence; before them, on layer-2 stages, the seeds are cheaper while they find one."""
        return self.on


class SuffixSeeder:
    """One right-to-left growth per length hypothesis on a stage's objective, with counted work
    (`steps`: sentences scored, part of the stage's); `hits`: sentences that passed the exact
    check, in the order found."""

    def __init__(self, stage: Stage, specials: Specials, tol_cls: float = 0.0) -> None:
        self.stage, self.specials, self.tol_cls = stage, specials, tol_cls
        special = {v for v in (specials.sep, specials.cls, specials.pad) if v is not None}
        self.content = [
            torch.tensor([v for v in c.tolist() if v not in special], dtype=torch.long) for c in stage.cands
        ]
        self.filler = [self._filler(t) for t in range(len(self.content))]
        self.steps = 0
        self.hits: list[list[int]] = []

    def _filler(self, t: int) -> int:
        """What stands left of the growing suffix at t: the position prior's best content token."""
        c = self.content[t]
        if not len(c):
            return self.specials.pad if self.specials.pad is not None else 0
        best = self.stage.prior.best(t, c)
        return int(c[0]) if best is None else best

    def _score(self, ids: Tensor, t: int) -> Tensor:
        """The cost of each sentence at position t (`MLPScore.at` where the objective has it)."""
        score = self.stage.score
        c = score.at(ids, t) if hasattr(score, "at") else score(ids)[0][:, t]
        self.steps += len(ids)
        return c

    def grow(self, n: int, budget: int, sweeps: int | None = None) -> list[int] | None:
        """The sentence of length n grown from its end (module docstring), then swept again from
        its end with itself as the context until it passes the exact check, a sweep changes
        nothing or `sweeps` sweeps are done; None where the stage's scored sentences would pass
        `budget` first."""
        x = torch.tensor([[self.specials.cls, *self.filler[1 : n - 1], self.specials.sep]])
        dirty = set(range(1, n - 1))
        for _ in range(SWEEPS if sweeps is None else sweeps):
            if not self._sweep(x, budget, dirty):
                return None
            if not dirty or self.exact(x):
                break
        return x[0].tolist()

    def _sweep(self, x: Tensor, budget: int, dirty: set[int]) -> bool:
        """One right-to-left pass over x in place: each content position in `dirty` takes the
        candidate that makes the next position cost least, the rest of x as it stands (its own
        cost reads the tokens before it too: `REACH`); a change marks the positions within `REACH`
        for the next sweep. False where the budget would be passed first."""
        for t in range(x.shape[1] - 2, 0, -1):
            if t not in dirty:
                continue
            dirty.discard(t)
            opts = self.content[t]
            if self.stage.scored + len(opts) > budget:
                return False
            var = x.repeat(len(opts), 1)
            var[:, t] = opts
            c = self._score(var, t + 1)
            low = float(c.min())
            v = opts[int(torch.nonzero(c <= low + IMPROVE * max(abs(low), 1.0)).flatten()[0])]  # ties: the first
            if v != x[0, t]:
                x[0, t] = v
                dirty.update(u for u in range(t - REACH, t + REACH + 1) if 0 < u < x.shape[1] - 1 and u != t)
        return True

    def exact(self, x: Tensor) -> bool:
        """Whether x passes the stage's exact [CLS] test."""
        return bool(self.stage.score.cls(x) < self.tol_cls)


def suffix_seed(
    stage: Stage, specials: Specials, budget: int, tol_cls: float, growth: Growth | None = None
) -> list[list[int]]:
    """Grow one sentence from its end for every length hypothesis of the stage (shortest first),
    check each with the exact [CLS] test, restart each length's walker from its grown sentence;
    returns the sentences that passed (all lengths are grown: a pass finds several at once).
    With `growth`, the repair sweeps run only where the model's block 1 reads the token before
    each position (`reads_previous`, measured once per search): where it does not (a randomly
    initialised encoder), they cycle without finding a sentence and cost more than the growth itself."""
    if specials.cls is None or specials.sep is None or len(stage.cands) < 3:
        return []
    sd = SuffixSeeder(stage, specials, tol_cls)
    stage.grower = sd
    if growth is not None and growth.reads_previous is None:
        growth.reads_previous = reads_previous(sd, stage.walkers[-1].n) if stage.walkers else False
    for w in stage.walkers:
        sent = sd.grow(w.n, budget, sweeps=None if growth is None or growth.reads_previous else 1)
        if sent is None:
            break
        if sent not in sd.hits and sd.exact(torch.tensor([sent])):
            sd.hits.append(sent)
        else:
            w.restart(sent[1:-1])
    return list(sd.hits)


def reads_previous(sd: SuffixSeeder, n: int, probes: int = 8, alts: int = 4) -> bool:
    """Whether a position's cost moves more when the token before it changes than when one three
    before it does (`LOCAL` times the mean change), on the prior's filler sentence of length n at
    up to `probes` positions with `alts` other candidates each (counted in the seeder's steps).
    A pretrained encoder passes it by a wide margin, a randomly initialised one does not."""
    x = torch.tensor([[sd.specials.cls, *sd.filler[1 : n - 1], sd.specials.sep]])
    ts = list(range(4, n - 1))[:: max(1, (n - 5) // probes)][:probes]
    moved: dict[int, list[Tensor]] = {1: [], 3: []}
    for t in ts:
        for d in moved:
            opts = sd.content[t - d][: alts + 1]
            var = x.repeat(len(opts), 1)
            var[:, t - d] = opts
            c = sd._score(var, t)
            moved[d].append((c - c[0]).abs()[1:].mean())
    near, far = (float(torch.stack(v).mean()) if v else 0.0 for v in moved.values())
    return near > LOCAL * far
