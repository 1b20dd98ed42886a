"""Peeling search of the span attack for encoder classifiers ([CLS]- or mean-pooled) whose batch holds more tokens than
the layer-1 span can separate (B*T close to or above the width; Petrov et al. 2024 stop there).

Two exact tests the DAGER paper does not use, both from the attacker's own view (weights, loss,
the exported gradients):

* `CLSCheck` (`veil.attacks.span.checks`): a [CLS]-pooled classifier reads only the last block's
  [CLS] output, so the last block's Q projection gradient has rank <= B and its row space is
  spanned by the B [CLS] inputs of that block. A candidate sentence is in the batch iff its own
  [CLS] input lies in that span. A mean-pooled one (sentence-transformer checkpoints) reads every
  token's output: where the B*T rows leave that span a gap, a sentence is in the batch iff all
  its last-block inputs lie in it; where they leave none, `RowCheck` tests its embedding rows.
* `Residual`: the client's loss is the batch mean, so once a sentence and its label are known,
  its gradient (/ B) is subtracted from every exported gradient; the rest belongs to the other
  sentences alone, with fewer tokens behind each span (which regains its gap).

`peel_search` finds one sentence per stage: `setup_stage` reads the residual's spans, picks the
objective and the regime's plan (`veil.attacks.span.schedule`), `search_stage` runs the plan's
members (`veil.attacks.span.strategy`: pending hits, prefix seeds, suffix growth, walkers) until
one sentence passes the exact test; that sentence is peeled off and the next stage starts.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from torch import Tensor

from veil.attacks.base import Observation, work_bar
from veil.attacks.span.checks import CLSCheck, RowCheck, exact_check
from veil.attacks.span.core import Span, Specials
from veil.attacks.span.mlp import MLPScore, mlp_exact, mlp_fill, mlp_spans, mlp_usable
from veil.attacks.span.options import SpanOptions
from veil.attacks.span.prefix import PrefixSeeds
from veil.attacks.span.residual import Residual
from veil.attacks.span.schedule import SCHEDULE, Member, Plan, regime
from veil.attacks.span.score import Objective, PositionPrior, SentenceScore
from veil.attacks.span.strategy import Pending, Proposal, Strategy
from veil.attacks.span.suffix import SuffixGrowth
from veil.attacks.span.walks import Walks, best_guesses, length_walkers
from veil.attacks.span.work import Meter, WorkSpent


@dataclass(frozen=True)
class Stage:
    """One sentence's search on the current residual: its spans' ranks, candidates, objective,
    exact test and plan, the walks of its length hypotheses, and the search's other members (for
    the sentences scored). Members read it as a `StageView`; nothing in it is reassigned."""

    check: CLSCheck | RowCheck
    rank1: int
    rank2: int
    crowded: bool  # the layer-2 span alone no longer pins positions (codimension < `crowded` x width)
    prior: PositionPrior
    score: SentenceScore
    cands: list[Tensor]  # the layer-1 candidates per position
    left: int  # sentences left in the residual
    objective: Objective
    gate: float  # the prefix seeds' layer-2 gate before the exact test (+inf on the MLP objectives)
    plan: Plan
    walks: Walks
    opts: SpanOptions
    members: tuple[Strategy, ...] = ()  # the search's members besides the walks (their steps count here)

    @property
    def lengths(self) -> list[int]:
        return [w.n for w in self.walks.walkers]

    @property
    def tol(self) -> float:
        return self.check.tol

    @property
    def scored(self) -> int:
        return self.walks.steps + sum(m.steps for m in self.members)


@dataclass
class Members:
    """The search's members that outlive a stage: the pending hits, the prefix seeds, the suffix growth."""

    pending: Pending
    prefix: PrefixSeeds
    suffix: SuffixGrowth

    def of(self, member: Member) -> Strategy:
        return {Member.PENDING: self.pending, Member.PREFIX: self.prefix, Member.SUFFIX: self.suffix}[member]


def _objective(
    res: Residual, check: CLSCheck | RowCheck, span2: Span, prior: PositionPrior, opts: SpanOptions
) -> tuple[SentenceScore, Objective, bool, float]:
    """The stage's scorer, objective, whether it is crowded and the MLP span's fill: the MLP
    down-projections where layer 2 is crowded or tight (`mlp_codim`) and they still pin positions,
    else the layer-2 distance (crowded: with the gradient match, the [CLS] distance and the prior)."""
    gap = span2.width - span2.rank
    crowded = gap < span2.width * opts.crowded
    tight = gap < opts.mlp_codim * span2.width  # layer 2's gap is narrow
    mlp = mlp_spans(res, opts.mlp_blocks) if (crowded or tight) and opts.mlp_blocks > 0 else []
    if mlp_usable(
        mlp, opts.mlp_max_fill
    ):  # the MLP down-projections still pin positions: searched as an uncrowded span
        objective = Objective.MLP if mlp_exact(mlp) else Objective.MLP_GRADED
        return MLPScore(res.model, mlp, span2, check), objective, False, mlp_fill(mlp)
    score = SentenceScore(
        res.model,
        span2,
        check,
        with_cls=crowded,
        cls_weight=opts.cls_weight,
        tok_grad=res.token_grad(),
        batch_size=res.batch_size,
        cap=opts.grad_cap,
        prior=prior if prior.cost is not None and crowded else None,
    )
    return score, Objective.LAYER2, crowded, 0.0


def setup_stage(
    res: Residual,
    check: CLSCheck | RowCheck,
    cands_of: Callable[[Span], list[Tensor]],
    specials: Specials,
    rng: np.random.Generator,
    carried: dict[int, list[int]],
    opts: SpanOptions,
    members: tuple[Strategy, ...] = (),
    past: bool = False,
) -> Stage:
    """Spans and layer-1 candidates of the residual, the objective and its plan (`past`: the
    search met the graded MLP objective before), and one walker per length hypothesis, started at
    the position prior's best tokens (or where the previous stage's walk of that length stood)."""
    span1, span2 = res.layer_span(0, opts.rank_tol), res.layer_span(1, opts.rank_tol)
    cands = cands_of(span1)
    prior = PositionPrior(res, len(cands), weight=opts.prior_weight)
    score, objective, crowded, fill = _objective(res, check, span2, prior, opts)
    plan = SCHEDULE[regime(objective, crowded, past or fill >= opts.suffix_near)]
    walks = _walks(cands, specials, rng, carried, prior, not crowded, plan, opts)
    gate = float("inf") if objective != Objective.LAYER2 else opts.tol2
    ranks = (span1.rank, span2.rank)
    stage = Stage(check, *ranks, crowded, prior, score, cands, res.left, objective, gate, plan, walks, opts, members)
    for m in members:
        m.begin(stage)
    return stage


def _walks(
    cands: list[Tensor],
    specials: Specials,
    rng: np.random.Generator,
    carried: dict[int, list[int]],
    prior: PositionPrior,
    narrow: bool,
    plan: Plan,
    opts: SpanOptions,
) -> Walks:
    """One walker per length hypothesis, started at the position prior's best tokens, or where the
    previous stage's walk of that length stood; `narrow`: sweeps try the prior's `narrow` likeliest
    tokens first (not on the crowded objective)."""
    walkers = length_walkers(cands, specials, rng, opts)
    for w in walkers:
        w.start_at(prior)
        if w.n in carried:  # the walk of the stage before, at this length, resumes where it stood
            w.seed(carried[w.n][1:-1])
        if narrow and opts.narrow > 0:
            w.narrow = opts.narrow
    return Walks(walkers, prior, specials.sep, set(carried), opts, plan.reseed, plan.merit)


def search_stage(
    stage: Stage, members: Members, budget: int, tick: Callable[[], None] = lambda: None
) -> list[int] | None:
    """Run the stage's plan until one sentence passes the exact test (distance < `tol_cls`, every
    row: `tol_all`, the embedding rows: `tol_row`) or `budget` sentences are scored on the stage:
    the plan's `before` members once each, in order, then its loop (`_walk` or `_turns`); returns
    that sentence or None. `tick` is called after each walker step and each turn of seeds."""
    for m in stage.plan.before:
        hit = _take(stage, members, members.of(m).propose(stage, budget))
        if hit is not None:
            return hit
    if stage.plan.loop == Member.TURNS and members.prefix.on:
        return _turns(stage, members, budget, tick)
    return _walk(stage, members, budget, tick)


def _walk(stage: Stage, members: Members, budget: int, tick: Callable[[], None]) -> list[int] | None:
    """The walkers alone, by fair share of work (`veil.attacks.span.walks`)."""
    while stage.scored < budget:
        hit = _take(stage, members, stage.walks.propose(stage, budget))
        tick()
        if hit is not None:
            return hit
    return None


def _turns(stage: Stage, members: Members, budget: int, tick: Callable[[], None]) -> list[int] | None:
    """The prefix seeds and the walkers in turns: one first token's growth, then as many sentences
    scored by the walkers, until no first token is left (then the walkers alone). On a graded
    objective the seeds run first can spend a whole budget on one stage, and the walkers alone
    settle on chimeras; in turn each covers the other's trap."""
    cap, turns = stage.scored, True
    while stage.scored < budget:
        if turns and stage.scored >= cap:
            before = stage.scored
            hit = _take(stage, members, members.prefix.turn(stage, budget))
            if hit is not None:
                return hit
            tick()
            turns = members.prefix.more
            cap = min(budget, stage.scored + max(stage.scored - before, 1)) if turns else budget
            continue
        hit = _take(stage, members, stage.walks.propose(stage, cap))  # never past the turn's share
        tick()
        if hit is not None:
            return hit
    return None


def _take(stage: Stage, members: Members, proposal: Proposal) -> list[int] | None:
    """Apply a proposal: its restarts to the walkers, in order (then `WorkSpent` where the turn ran
    out of block-rows); its first exact sentence is the stage's (None: none), the others wait in
    the pending hits."""
    for n, content in proposal.restarts:
        stage.walks.restart(n, content)
    if proposal.spent:
        raise WorkSpent
    if not proposal.hits:
        return None
    members.pending.keep(proposal.hits[1:])
    return proposal.hits[0]


def stage_report(stage: Stage, suffix_hits: int | None, hit: list[int] | None, seconds: float) -> dict[str, Any]:
    """What one stage did: ranks, hypotheses, rounds, the busiest lengths' work and sweeps."""
    walks = stage.walks
    busiest = sorted(zip(walks.walkers, walks.used), key=lambda x: -x[1])[:REPORTED]
    return {
        "left": stage.left,
        "rank1": stage.rank1,
        "rank2": stage.rank2,
        "objective": stage.objective,
        "hypotheses": len(walks.walkers),
        "rounds": walks.rounds,
        "scored": stage.scored,
        "suffix_hits": suffix_hits,
        "seconds": round(seconds, 1),
        "length": len(hit) if hit else None,
        "lengths": stage.lengths,
        "work_by_length": {w.n: int(u) for w, u in busiest},
        "sweeps_by_length": {w.n: w.sweeps for w, _ in busiest},
    }


#: the busiest lengths a stage's report lists
REPORTED = 6


class Peeling:
    """One peeling search's state across its stages: the sentences found and their labels, the
    work done, each stage's report, the best guesses where it stopped, the walks' bests carried to
    the next stage, and the members that outlive a stage (`Members`)."""

    def __init__(self, res: Residual, specials: Specials, opts: SpanOptions, seed: int, seeds: bool) -> None:
        self.res, self.specials, self.opts = res, specials, opts
        self.rng = np.random.default_rng(seed)
        self.members = Members(Pending(), PrefixSeeds(specials, seeds), SuffixGrowth(specials, opts.suffix_seeds))
        self.found: list[list[int]] = []
        self.labels: list[int] = []
        self.steps = self.rounds = 0
        self.reports: list[dict[str, Any]] = []
        self.guesses: list[list[int]] = []
        self.carried: dict[int, list[int]] = {}  # per length, the best sentence of the previous stage's walker
        self.note: str | None = None
        self.budget = opts.sentences(res.batch_size)
        self.bar = work_bar(self.budget, "span")  # sentences scored, all stages; shown where `attack_progress` is on
        self.meter = Meter(limit=opts.work * res.batch_size)
        self.start = time.perf_counter()

    def stage(self, check: CLSCheck | RowCheck, cands_of: Callable[[Span], list[Tensor]]) -> bool:
        """Search one stage and peel what it found; False where the search ends here."""
        t0 = time.perf_counter()
        m = self.members
        stage = setup_stage(
            self.res,
            check,
            cands_of,
            self.specials,
            self.rng,
            self.carried,
            self.opts,
            (m.prefix, m.suffix),
            m.suffix.past,
        )
        stage.score.meter = self.meter
        if not stage.walks.walkers:
            self.reports.append(stage_report(stage, m.suffix.hits, None, time.perf_counter() - t0))
            self.note = None if self.found else "no token passes layer 1 (dropout or noise? raise tol1)"
            return False
        hit = self._search(stage)
        self.steps += stage.scored
        self.rounds += stage.walks.rounds
        self.bar.update(self.steps - self.bar.n)
        self.bar.set_postfix(exact=len(self.found) + (hit is not None), block_rows=self.meter.done, refresh=False)
        self.reports.append(stage_report(stage, m.suffix.hits, hit, time.perf_counter() - t0))
        if hit is None:
            self.guesses = best_guesses(stage.walks.walkers)
            return False
        self._peel(stage, check, hit)
        return True

    def _search(self, stage: Stage) -> list[int] | None:
        """`search_stage` within what is left of the budget; at the block-row budget (`WorkSpent`)
        this stage's best guesses stand for the sentences left."""
        done = self.steps

        def tick() -> None:
            self.bar.update(done + stage.scored - self.bar.n)

        try:
            return search_stage(stage, self.members, self.budget - self.steps, tick)
        except WorkSpent:
            for w in stage.walks.walkers:
                w.hold()
            return None

    def _peel(self, stage: Stage, check: CLSCheck | RowCheck, hit: list[int]) -> None:
        """Subtract the found sentence with its inferred label; the walks' other bests carry over."""
        carried = {w.n: w.best[2][0].tolist() for w in stage.walks.walkers if w.best is not None}
        self.carried = {n: s for n, s in carried.items() if s != hit}
        label, _ = self.res.peel(hit, check)
        self.found.append(hit)
        self.labels.append(label)

    def result(self) -> tuple[list[list[int]], dict[str, Any]]:
        """The exact sentences (found, then pending ones not peeled yet), then the best guesses for
        the rest, an empty sentence where there is none; and the search's statistics."""
        self.bar.close()
        B = self.res.batch_size
        exact = self.found + [s for s in self.members.pending.queue if s not in self.found]
        seqs = exact + self.guesses[: max(0, B - len(exact))]  # unsolved: the best guesses
        seqs += [[] for _ in range(B - len(seqs))]  # no guess: an empty sentence (scored, not skipped)
        info = {
            "sentences_exact": len(self.found),
            "walker_steps": self.rounds,
            "sentences_scored": self.steps,
            "block_rows": self.meter.done,
            "work_stopped": self.meter.stopped,
            "stages": self.reports,
            "labels_inferred": self.labels,
            "search_seconds": time.perf_counter() - self.start,
        }
        return seqs, ({"note": self.note, **info} if self.note else info)


def peel_search(
    obs: Observation,
    res: Residual,
    cands_of: Callable[[Span], list[Tensor]],
    specials: Specials,
    opts: SpanOptions,
    *,
    seed: int,
    seeds: bool,
) -> tuple[list[list[int]], dict[str, Any]] | None:
    """Find the batch one sentence at a time (see `Residual`, `CLSCheck`). Each stage: the exact
    test of the residual (`exact_check`), its objective, plan and walkers (`setup_stage`), the
    plan's members until one sentence passes (`search_stage`), then that sentence is subtracted
    (`Residual.peel`) and the next stage starts from the new residual. `cands_of(span1)` gives the
    per-position candidates of a layer-1 span; `seeds`: whether the prefix seeds run. Returns None
    if the exact test does not apply.

    Work, never time, orders and bounds the search, so the result does not depend on the machine
    or its load: `opts.sentences(B)` caps the candidate sentences scored (all stages together) and
    `opts.work` x the batch size the block-rows their scoring computed (`veil.attacks.span.work`:
    what tracks the time a search takes). Where that would be passed the stage stops there and the
    search returns what it has: the exact sentences found and the best guesses of the stage it was in."""
    run = Peeling(res, specials, opts, seed, seeds)
    while res.left > 0 and run.steps < run.budget:
        check = exact_check(res, opts)
        if not check.usable:
            if not run.found:
                run.bar.close()
                return None
            break
        if not run.stage(check, cands_of):
            break
    return run.result()
