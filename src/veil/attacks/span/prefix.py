"""Peeling's left-to-right seeds for a bidirectional encoder (`veil.attacks.span.peel`).

Once a batch holds more (token, position) pairs than the bag's tokens plus positions span,
layer 1 admits almost every bag token at every position: it no longer narrows anything, every
length is a hypothesis and the walkers' coordinate descent from the position prior settles on
chimeras of several sentences or on the prefix of a longer one.

An encoder cannot verify a prefix exactly (its layer-2 input at t depends on the whole sentence),
but a true prefix's last position is still nearly in the layer-2 span: fed ``[CLS] s_1 .. s_k`` the
true token at k has the lowest layer-2 distance at k of all the bag's tokens at most positions
(the misses are at the first positions, where the context is short, and at a few tokens that
depend on later context). So `prefix_seed` grows a
sentence greedily from each of the position prior's likeliest first tokens, one position at a
time (the candidates: the prior's `width` likeliest tokens there), and at every step scores the
same prefix closed by [SEP] as a whole sentence: a layer-2-exact one is checked with the [CLS]
test at once. Otherwise the lengths whose closed sentence lies closest to the span seed the
walkers of those lengths, which sweep the whole sentence (every candidate at every position,
the full context fixing the early tokens) a few times. Counted work throughout, like the walkers.
"""

from __future__ import annotations

import torch
from torch import Tensor

from veil.attacks.span.core import Specials
from veil.attacks.span.score import Objective, PositionPrior
from veil.attacks.span.strategy import Proposal, StageView
from veil.attacks.span.work import WorkSpent


def ranked_tokens(cands: list[Tensor], prior: PositionPrior, special: set[int]) -> list[list[int]]:
    """Per position, its content candidates by the position prior's cost (stable: ties keep the
    vocabulary's order), or in the vocabulary's order without a prior."""
    out = []
    for t, c in enumerate(cands):
        c = torch.tensor([v for v in c.tolist() if v not in special], dtype=torch.long)
        if len(c) and prior.cost is not None and t < prior.cost.shape[0]:
            c = c[prior.cost[t, c].argsort(stable=True)]
        out.append(c.tolist())
    return out


#: relative decrease of a repaired sentence's summed layer-2 distance that counts as a move: above
#: float32 rounding of the sum, below what one token put right changes
REPAIR_MARGIN = 1e-4


class PrefixSeeder:
    """Beam-grown prefixes and their whole-sentence repair (`prefix_seed`), with the counted work.
    `hits`: the sentences that passed the exact check, in the order found."""

    def __init__(self, view: StageView, specials: Specials) -> None:
        self.view, self.specials = view, specials
        # the search's shape (`SpanOptions.prefix_*`): candidates per position (the position prior's
        # likeliest tokens), prefixes kept per step, lengths of a grown path repaired (its closest
        # closed sentences), repair rounds, and the positions a repair round revisits
        o = view.opts
        self.beam, self.ends, self.rounds, self.worst = o.prefix_beam, o.prefix_ends, o.prefix_rounds, o.prefix_worst
        special = {v for v in (specials.sep, specials.cls, specials.pad) if v is not None}
        self.ranked = ranked_tokens(view.cands, view.prior, special)
        self.content = [torch.tensor(r, dtype=torch.long) for r in self.ranked]
        # on the MLP objective (`veil.attacks.span.mlp`, batches past layer 2's reach) every candidate: the position
        # prior has lost its order there, and its likeliest tokens often miss the true one
        mlp = view.objective in (Objective.MLP, Objective.MLP_GRADED)
        self.width: int | None = None if mlp else o.prefix_width
        self.steps = 0  # sentences scored
        self.hits: list[list[int]] = []
        self.repaired: list[list[int]] = []  # sentences already repaired (a path equal to one is not repaired again)
        self.done: set[int] = set()  # first tokens grown on this stage
        self.left = 0  # first tokens of this stage not grown yet (after the last `prefix_seed`)

    def _score(self, ids: Tensor) -> Tensor:
        pc, _ = self.view.score(ids)
        self.steps += len(ids)
        return pc

    def _exact(self, ids: list[int], pc: Tensor, tol2: float, tol_cls: float) -> bool:
        if float(pc.max()) >= tol2 or ids in self.hits:
            return False
        return self.view.score.cls(torch.tensor([ids])) < tol_cls

    def grow(self, first: int, budget: int, tol2: float, tol_cls: float) -> tuple[list[int], list[tuple[float, int]]]:
        """A beam of `beam` prefixes from ``[CLS] first``, each step extended by every position's
        `width` likeliest tokens and ranked by the summed layer-2 distance of each prefix's last
        position when it was added; every prefix of the beam is also scored closed by [SEP] (a
        whole sentence; an exact one goes to `hits`). Returns the best path and its ancestors'
        closed sentences as (mean layer-2 distance, length); the stage never scores past `budget`."""
        cls, sep = self.specials.cls, self.specials.sep
        beam: list[tuple[float, list[int], list[tuple[float, int]]]] = [(0.0, [cls, first], [])]
        for k in range(2, len(self.ranked)):
            opts = self.ranked[k][: self.width]
            if not opts or self.view.scored + len(beam) * (len(opts) + 1) > budget:
                break
            var = torch.tensor([p + [v] for _, p, _ in beam for v in [*opts, sep]])
            d = self._score(var).view(len(beam), len(opts) + 1, k + 1)
            nxt = []
            for i, (f, p, closed) in enumerate(beam):
                if self._exact(p + [sep], d[i, -1], tol2, tol_cls):
                    self.hits.append(p + [sep])
                nxt += [
                    (
                        f + float(d[i, j, k]),
                        p + [v],
                        [*closed, (float(d[i, -1, k] / d[i, :-1, k].min().clamp_min(1e-12)), k + 1)],
                    )
                    for j, v in enumerate(opts)
                ]
            nxt.sort(key=lambda x: x[0])  # stable: ties keep the beam's and the prior's order
            beam = nxt[: self.beam]
        _, path, closed = beam[0]
        return path, closed

    def repair(self, sent: list[int], budget: int, tol2: float, tol_cls: float) -> list[int]:
        """Coordinate descent on the whole sentence, each round only at its `worst` positions by
        layer-2 distance (the full context makes a wrong token stand out: ~0.15 against <= 0.05
        for the right ones with five wrong), every candidate there, the worst first; up to
        `rounds` rounds. An exact result goes to `hits`; returns the repaired sentence."""
        x = torch.tensor([sent])
        n = len(sent)
        if self.view.scored + 1 > budget:
            return sent
        pc = self._score(x)[0]
        f = float(pc.sum())
        for _ in range(self.rounds):
            if self._exact(x[0].tolist(), pc, tol2, tol_cls):
                self.hits.append(x[0].tolist())
                break
            order = pc[1 : n - 1].argsort(descending=True, stable=True)[: self.worst] + 1
            moved = False
            for t in order.tolist():
                opts = self.content[t] if t < len(self.content) else torch.zeros(0, dtype=torch.long)
                if not len(opts) or self.view.scored + len(opts) > budget:
                    continue
                var = x.repeat(len(opts), 1)
                var[:, t] = opts
                d = self._score(var)
                j = int(d.sum(1).argmin())
                if float(d[j].sum()) < f - REPAIR_MARGIN * max(f, 1.0):
                    x, pc, f, moved = var[j : j + 1].clone(), d[j], float(d[j].sum()), True
            if not moved:
                break
        else:
            if self._exact(x[0].tolist(), pc, tol2, tol_cls):
                self.hits.append(x[0].tolist())
        return x[0].tolist()


class PrefixSeeds:
    """The prefix seeds as a member of the search (`veil.attacks.span.strategy`): a whole pass
    (`propose`), or one first token's growth per turn with the walkers (`turn`, the graded MLP
    objective's schedule). Keeps the first tokens grown: over the search for whole passes, over the
    stage for turns (each stage grows from the prior's likeliest first tokens again)."""

    def __init__(self, specials: Specials, on: bool) -> None:
        self.specials, self.on = specials, on
        self.grown: dict[int, int] = {}  # first tokens whole passes grew from, over the search, and how often
        self.fresh: dict[int, int] = {}  # the same for this stage's turns
        self.seeder: PrefixSeeder | None = None  # this stage's, made on first use

    @property
    def steps(self) -> int:
        return self.seeder.steps if self.seeder is not None else 0

    @property
    def more(self) -> bool:
        """Whether a turn is left: first tokens of this stage not grown yet."""
        return self.seeder is not None and self.seeder.left > 0

    def begin(self, view: StageView) -> None:
        self.seeder, self.fresh = None, {}

    def propose(self, view: StageView, budget: int) -> Proposal:
        """A whole pass (`prefix_seed`) where the seeds are on."""
        return self._seed(view, budget, self.grown, None) if self.on else Proposal()

    def turn(self, view: StageView, budget: int) -> Proposal:
        """One first token's growth (`prefix_seed` with `limit` 1)."""
        return self._seed(view, budget, self.fresh, 1)

    def _seed(self, view: StageView, budget: int, grown: dict[int, int], limit: int | None) -> Proposal:
        if self.specials.cls is None or self.specials.sep is None or len(view.cands) < 3:
            return Proposal()
        if self.seeder is None:
            self.seeder = PrefixSeeder(view, self.specials)
        return prefix_seed(view, self.seeder, budget, grown, limit)


def prefix_seed(
    view: StageView, sd: PrefixSeeder, budget: int, grown: dict[int, int], limit: int | None = None
) -> Proposal:
    """Grow beam paths from the position prior's likeliest first tokens (`view.left` +
    `prefix_starts` of them; those grown on fewer earlier stages first, `grown` counting them; at
    most `limit` per call, each once per stage) and repair each path's likeliest lengths (module
    docstring), until a sentence passes the exact test or the stage's scored sentences reach
    `budget`. Proposes the sentences that passed and the repaired sentences as restarts of their
    lengths' walkers."""
    out = Proposal()
    starts = view.left + view.opts.prefix_starts
    first = [v for v in (sd.ranked[1][:starts] if len(sd.ranked) > 1 else []) if v not in sd.done]
    for k, v in enumerate(sorted(first, key=lambda v: grown.get(v, 0))):  # stable: the prior's order among equals
        if view.scored >= budget or sd.hits or (limit is not None and k >= limit):
            break
        grown[v] = grown.get(v, 0) + 1
        sd.done.add(v)
        try:
            _repair_path(view, sd, v, budget, out)
        except WorkSpent:
            out.spent = True
            return out
    sd.left = len([v for v in first if v not in sd.done])
    out.hits = list(sd.hits)
    return out


def _repair_path(view: StageView, sd: PrefixSeeder, first: int, budget: int, out: Proposal) -> None:
    """Grow the beam path from `first` and repair its `ends` likeliest lengths, each once per
    stage; a repaired sentence that did not pass restarts its length's walker (`out.restarts`)."""
    path, closed = sd.grow(first, budget, view.gate, view.tol)
    for _, n in sorted(closed)[: sd.ends]:
        sent = path[: n - 1] + [sd.specials.sep]
        if sd.hits or sent in sd.repaired or view.scored >= budget:
            break
        sd.repaired.append(sent)
        fixed = sd.repair(sent, budget, view.gate, view.tol)
        if n in view.lengths and fixed not in sd.hits:
            out.restarts.append((n, fixed[1 : n - 1]))  # scored afresh: the walk may be mid-sweep
