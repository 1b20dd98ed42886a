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
from its end with itself as the context (`SuffixSeeder.grow`, at most `suffix_sweeps`, only positions
within `suffix_reach` of a change, until it passes the exact test or stops changing). The sweeps run
only where the model's block 1 reads the token before each position (`reads_previous`). When a
search grows first is the schedule's (`veil.attacks.span.schedule`). What a pass misses: it grows one sentence per length, so
of several sentences of the same length at most one is found per pass. Figures: docs/results.md
(span-scale) and docs/span.md.
"""

from __future__ import annotations

import torch
from torch import Tensor

from veil.attacks.span.core import Specials
from veil.attacks.span.score import Objective
from veil.attacks.span.strategy import Proposal, StageView
from veil.attacks.span.walker import IMPROVE
from veil.attacks.span.work import WorkSpent

#: the offset of the far probe of `reads_previous`: a position's cost against the token three before it
FAR = 3


class SuffixGrowth:
    """The suffix growth as a member of the search (`veil.attacks.span.strategy`): one pass per
    stage where it runs (`suffix_seed`). Keeps what holds for the whole search: whether it met the
    graded MLP objective (`past`: then it runs first on every MLP stage, `veil.attacks.span.schedule`)
    and whether the model's block 1 reads the token before each position (`reads_previous`,
    tested on the search's first growth: the repair sweeps run only then)."""

    def __init__(self, specials: Specials, on: bool) -> None:
        self.specials, self.on = specials, on
        self.past = False
        self.reads_previous: bool | None = None
        self.seeder: SuffixSeeder | None = None  # this stage's, where it ran

    @property
    def steps(self) -> int:
        return self.seeder.steps if self.seeder is not None else 0

    @property
    def hits(self) -> int | None:
        """Sentences this stage's growth found (None: it did not run)."""
        return len(self.seeder.hits) if self.seeder is not None else None

    def begin(self, view: StageView) -> None:
        self.seeder = None

    def propose(self, view: StageView, budget: int) -> Proposal:
        """Grow every length's sentence from its end (`suffix_seed`) where the growth is on."""
        self.past = self.past or view.objective == Objective.MLP_GRADED
        sp = self.specials
        if not self.on or sp.cls is None or sp.sep is None or len(view.cands) < 3:
            return Proposal()
        sd = self.seeder = SuffixSeeder(view, sp, view.tol)
        if self.reads_previous is None:
            self.reads_previous = reads_previous(sd, view.lengths[-1]) if view.lengths else False
        return suffix_seed(view, sd, budget, sweeps=None if self.reads_previous else 1)


class SuffixSeeder:
    """One right-to-left growth per length hypothesis on a stage's objective, with counted work
    (`steps`: sentences scored, part of the stage's); `hits`: sentences that passed the exact
    check, in the order found."""

    def __init__(self, view: StageView, specials: Specials, tol_cls: float = 0.0) -> None:
        self.view, self.specials, self.tol_cls, self.opts = view, specials, tol_cls, view.opts
        special = {v for v in (specials.sep, specials.cls, specials.pad) if v is not None}
        self.content = [torch.tensor([v for v in c.tolist() if v not in special], dtype=torch.long) for c in view.cands]
        self.filler = [self._filler(t) for t in range(len(self.content))]
        self.steps = 0
        self.hits: list[list[int]] = []

    def _filler(self, t: int) -> int:
        """What stands left of the growing suffix at t: the position prior's best content token."""
        c = self.content[t]
        if not len(c):
            return self.specials.pad if self.specials.pad is not None else 0
        best = self.view.prior.best(t, c)
        return int(c[0]) if best is None else best

    def _score(self, ids: Tensor, t: int) -> Tensor:
        """The cost of each sentence at position t (`MLPScore.at` where the objective has it)."""
        score = self.view.score
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
        for _ in range(self.opts.suffix_sweeps if sweeps is None else sweeps):
            if not self._sweep(x, budget, dirty):
                return None
            if not dirty or self.exact(x):
                break
        return x[0].tolist()

    def _sweep(self, x: Tensor, budget: int, dirty: set[int]) -> bool:
        """One right-to-left pass over x in place: each content position in `dirty` takes the
        candidate that makes the next position cost least, the rest of x as it stands (its own
        cost reads the tokens before it too: `suffix_reach`); a change marks the positions within it
        for the next sweep. False where the budget would be passed first."""
        for t in range(x.shape[1] - 2, 0, -1):
            if t not in dirty:
                continue
            dirty.discard(t)
            opts = self.content[t]
            if self.view.scored + len(opts) > budget:
                return False
            var = x.repeat(len(opts), 1)
            var[:, t] = opts
            c = self._score(var, t + 1)
            low = float(c.min())
            v = opts[int(torch.nonzero(c <= low + IMPROVE * max(abs(low), 1.0)).flatten()[0])]  # ties: the first
            if v != x[0, t]:
                x[0, t] = v
                reach = self.opts.suffix_reach
                dirty.update(u for u in range(t - reach, t + reach + 1) if 0 < u < x.shape[1] - 1 and u != t)
        return True

    def exact(self, x: Tensor) -> bool:
        """Whether x passes the stage's exact [CLS] test."""
        return bool(self.view.score.cls(x) < self.tol_cls)


def suffix_seed(view: StageView, sd: SuffixSeeder, budget: int, sweeps: int | None = None) -> Proposal:
    """Grow one sentence from its end for every length hypothesis of the stage (shortest first, at
    most `sweeps` sweeps each, unset: `suffix_sweeps`) and check each with the exact test; proposes
    the sentences that passed (all lengths are grown: a pass finds several at once) and the others
    as restarts of their lengths' walkers. The repair sweeps pay only where the model's block 1
    reads the token before each position (`reads_previous`): where it does not (a randomly
    initialised encoder) they cycle without finding a sentence and cost more than the growth itself."""
    out = Proposal()
    try:
        for n in view.lengths:
            sent = sd.grow(n, budget, sweeps=sweeps)
            if sent is None:
                break
            if sent not in sd.hits and sd.exact(torch.tensor([sent])):
                sd.hits.append(sent)
            else:
                out.restarts.append((n, sent[1:-1]))
    except WorkSpent:
        out.spent = True
    out.hits = list(sd.hits)
    return out


def reads_previous(sd: SuffixSeeder, n: int) -> bool:
    """Whether a position's cost moves more when the token before it changes than when one three
    before it does (`suffix_local` times the mean change), on the prior's filler sentence of length
    n at up to `suffix_probes` positions with `suffix_alts` other candidates each (counted in the
    seeder's steps).
    A pretrained encoder passes it by a wide margin, a randomly initialised one does not."""
    x = torch.tensor([[sd.specials.cls, *sd.filler[1 : n - 1], sd.specials.sep]])
    probes, alts = sd.opts.suffix_probes, sd.opts.suffix_alts
    ts = list(range(FAR + 1, n - 1))[:: max(1, (n - FAR - 2) // probes)][:probes]
    moved: dict[int, list[Tensor]] = {1: [], FAR: []}
    for t in ts:
        for d in moved:
            opts = sd.content[t - d][: alts + 1]
            var = x.repeat(len(opts), 1)
            var[:, t - d] = opts
            c = sd._score(var, t)
            moved[d].append((c - c[0]).abs()[1:].mean())
    near, far = (float(torch.stack(v).mean()) if v else 0.0 for v in moved.values())
    return near > sd.opts.suffix_local * far
