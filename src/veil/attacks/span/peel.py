"""Peeling search of the span attack for encoder classifiers ([CLS]- or mean-pooled) whose batch holds more tokens than
the layer-1 span can separate (B*T close to or above the width; Petrov et al. 2024 stop there).

Two exact tests the DAGER paper does not use, both from the attacker's own view (weights, loss,
the exported gradients):

* `CLSCheck` (`veil.attacks.span.checks`): a [CLS]-pooled classifier reads only the last block's
  [CLS] output, so the last block's Q projection gradient has rank <= B and its row space is
  spanned by the B [CLS] inputs of that block. A candidate sentence is in the batch iff its own
  [CLS] input lies in that span. A mean-pooled one (sentence-transformer checkpoints) reads every
  token's output: where the B*T rows leave that span a gap, a sentence is in the batch iff all
  its last-block inputs lie in it.
* `Residual`: the client's loss is the batch mean, so once a sentence and its label are known,
  its gradient (/ B) is subtracted from every exported gradient; the rest belongs to the other
  sentences alone, with fewer tokens behind each span (which regains its gap).

`peel_search` finds one sentence at a time by an iterated local search (`Walker`) per length
hypothesis on the layer-2 span distance plus the token-embedding-gradient match (`SentenceScore`),
accepts the first sentence that passes `CLSCheck`, peels it off and repeats. Uncrowded, every
other kick of a walk restarts it from another length's best sentence (`cross_seed`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import torch
from torch import Tensor

from veil.attacks.base import Observation, work_bar
from veil.attacks.span.checks import CLSCheck, RowCheck, exact_check
from veil.attacks.span.core import Span, Specials, last_position
from veil.attacks.span.mlp import MLPScore, mlp_exact, mlp_fill, mlp_spans, mlp_usable
from veil.attacks.span.options import DEFAULTS, SpanOptions
from veil.attacks.span.prefix import PrefixSeeder, prefix_seed
from veil.attacks.span.residual import Residual
from veil.attacks.span.score import Objective, PositionPrior, SentenceScore
from veil.attacks.span.suffix import Growth, SuffixSeeder, suffix_seed
from veil.attacks.span.walker import CALL_COST, Walker
from veil.attacks.span.work import Meter, WorkSpent

#: the shortest length hypothesis: [CLS], one token, [SEP]
MIN_LEN = 3


@dataclass
class Stage:
    """One sentence's search on the current residual: its spans, candidates, objective and the
    walkers of its length hypotheses, with the work each has used."""

    check: CLSCheck | RowCheck
    rank1: int
    rank2: int
    crowded: bool  # the layer-2 span alone no longer pins positions (codimension < width / 8)
    prior: PositionPrior
    score: SentenceScore
    walkers: list[Walker]
    used: list[float] = field(default_factory=list)
    rounds: int = 0
    tried: set[tuple[int, tuple[int, ...]]] = field(default_factory=set)  # cross seeds used (`cross_seed`)
    cands: list[Tensor] = field(default_factory=list)  # the layer-1 candidates per position
    seeder: PrefixSeeder | None = None  # the left-to-right seeds (`veil.attacks.span.prefix`), made on first use
    grower: SuffixSeeder | None = None  # the right-to-left seeds (`veil.attacks.span.suffix`), where they ran
    check_left: int = 1  # sentences left in the residual
    # what the walkers descend on; on the graded MLP objective the prefix seeds and the walkers take
    # turns (`search_stage`): the seeds run first spent a whole budget on one stage there
    objective: Objective = Objective.LAYER2
    tol2: float | None = None  # the prefix seeds' gate before the exact check (None: the search's tol2)
    tick: Callable[[], None] | None = (
        None  # called after each piece of work (a walker step, a seed pass): a progress bar
    )
    opts: SpanOptions = DEFAULTS  # the search's options (the prefix seeds read their shape here)

    @property
    def scored(self) -> int:
        seeds = sum(s.steps for s in (self.seeder, self.grower) if s is not None)
        return sum(w.steps for w in self.walkers) + seeds


def setup_stage(
    res: Residual,
    check: CLSCheck | RowCheck,
    cands_of: Callable[[Span], list[Tensor]],
    specials: Specials,
    rng: np.random.Generator,
    carried: dict[int, list[int]],
    opts: SpanOptions,
) -> Stage:
    """Spans and layer-1 candidates of the residual, the objective, and one walker per length
    hypothesis, started at the position prior's best tokens (or where the previous stage's walk
    of that length stood)."""
    span1, span2 = res.layer_span(0, opts.rank_tol), res.layer_span(1, opts.rank_tol)
    cands = cands_of(span1)
    crowded = span2.width - span2.rank < span2.width * opts.crowded
    prior = PositionPrior(res, len(cands), weight=opts.prior_weight)
    tight = span2.width - span2.rank < opts.mlp_codim * span2.width  # layer 2's gap is narrow
    mlp = mlp_spans(res, opts.mlp_blocks) if (crowded or tight) and opts.mlp_blocks > 0 else []
    score: SentenceScore
    if mlp_usable(mlp):  # the MLP down-projections still pin positions: searched as an uncrowded span
        score, crowded = MLPScore(res.model, mlp, span2, check), False
    else:
        mlp = []
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
    walkers = length_walkers(cands, specials, rng, opts.kick)
    for w in walkers:
        w.start_at(prior)
        if w.n in carried:  # the walk of the stage before, at this length, resumes where it stood
            w.seed(carried[w.n][1:-1])
        if not crowded and opts.narrow > 0:
            w.narrow = opts.narrow
    return Stage(
        check,
        span1.rank,
        span2.rank,
        crowded,
        prior,
        score,
        walkers,
        used=[0.0] * len(walkers),
        cands=cands,
        check_left=res.left,
        objective=(Objective.MLP if mlp_exact(mlp) else Objective.MLP_GRADED) if mlp else Objective.LAYER2,
        tol2=float("inf") if mlp else None,
        opts=opts,
    )


def search_stage(
    stage: Stage,
    specials: Specials,
    carried: dict[int, list[int]],
    budget: int,
    seeds: bool = False,
    pending: list[list[int]] | None = None,
    grown: dict[int, int] | None = None,
    growth: Growth | None = None,
) -> list[int] | None:
    """Step the walkers by fair share of work until one sentence passes the exact check
    (distance < `tol_cls`, with every row tested `tol_all`) or `budget` sentences are scored;
    returns that sentence or None.

    Fair share: step the hypothesis whose work after this step would be the least (relative to its
    merit, `_merit`). Work = tokens scored + CALL_COST per scoring call; a first sweep's is estimated
    as n * (candidates of its n positions) + CALL_COST per position, so short hypotheses, cheap to
    score, sweep several times before a long one starts. Uncrowded, a walker's first sweep starts
    from the longest sentence a shorter walker has settled on (often the prefix of a longer one).
    Ties go to the shorter hypothesis (a fixed order).

    With `seeds`, the prefix seeds (`veil.attacks.span.prefix`) run first; on a graded MLP
    objective they take turns with the walkers instead (one first token's growth, then as many
    sentences scored by the walkers), and a walk's new lowest best restarts its neighbouring
    lengths (`extend_seed`): on a graded objective the seeds run first can spend a whole budget on
    one stage, and the walkers alone settle on chimeras; in turn each covers the other's trap.

    With `growth` (`veil.attacks.span.suffix`), the right-to-left seeds run first on the graded MLP
    objective, on every MLP stage after one and on exact ones near the rank limit (`Growth.first`),
    else after prefix seeds that found nothing (`Growth.then`); docs/span.md tabulates this
    schedule and docs/results.md (span-scale, span-tail) what it recovers."""
    walkers, used = stage.walkers, stage.used
    tol_cls = stage.check.tol
    tol2, starts = stage.opts.tol2, stage.check_left + stage.opts.prefix_starts
    pending = [] if pending is None else pending
    for sent in list(pending):  # exact sentences a previous stage found beside the one it peeled
        pending.remove(sent)
        if stage.score.cls(torch.tensor([sent])) < tol_cls:
            return sent
    grown = {} if grown is None else grown
    grew = growth is not None and growth.first(stage.objective, mlp_fill(getattr(stage.score, "spans", [])))
    if grew:  # the right-to-left seeds (`veil.attacks.span.suffix`) before anything else
        hit = _take(suffix_seed(stage, specials, budget, tol_cls, growth), pending)
        if hit is not None:
            return hit
    # graded (the MLP span at its rank limit): one first token's prefix seeds, then as much work
    # for the walkers, in turn; else the seeds first, then the walkers
    turns = seeds and not stage.crowded and stage.objective == Objective.MLP_GRADED
    if seeds and not stage.crowded and not turns:
        hit = _take(prefix_seed(stage, specials, budget, _gate(stage, tol2), tol_cls, starts, grown), pending)
        if hit is not None:
            return hit
    if growth is not None and not grew and not stage.crowded and growth.then(stage.objective):  # seeds found none
        hit = _take(suffix_seed(stage, specials, budget, tol_cls, growth), pending)
        if hit is not None:
            return hit
    first = [float(w.n * w.sweep_size() + CALL_COST * (len(w.free) + 1)) for w in walkers]
    share = _shares(walkers, stage.prior, specials.sep)
    cap = stage.scored if turns else budget  # graded: the seeds first
    fresh: dict[int, int] = {}  # graded: each stage grows from the prior's likeliest first tokens again
    while stage.scored < budget:
        if turns and stage.scored >= cap:
            before = stage.scored
            hits = prefix_seed(stage, specials, budget, _gate(stage, tol2), tol_cls, starts, fresh, limit=1)
            hit = _take(hits, pending)
            if hit is not None:
                return hit
            if stage.tick is not None:
                stage.tick()
            turns = stage.seeder is not None and stage.seeder.left > 0  # None: no seeds here (no [CLS] / [SEP])
            cap = min(budget, stage.scored + max(stage.scored - before, 1)) if turns else budget
            continue
        est = [
            (used[j] + (w.last if w.last is not None else first[j])) / _merit(w, share[j], stage.crowded)
            for j, w in enumerate(walkers)
        ]
        i = min(range(len(walkers)), key=lambda j: (est[j], j))
        w = walkers[i]
        if w.sweeps == 0 and stage.score.prior is None and w.n not in carried:
            shorter = [v for v in walkers if v.best is not None and v.n < w.n]
            if shorter:
                w.seed(shorter[-1].best[2][0, 1:-1].tolist())
        before, had = w.work, w.best
        _, dc, ids = w.step(stage.score, cap - stage.scored)  # never past the budget
        if stage.tick is not None:
            stage.tick()
        w.last = w.work - before
        used[i] += w.last
        stage.rounds += 1
        if dc < tol_cls:
            return ids[0].tolist()
        if stage.objective == Objective.MLP_GRADED and w.best is not had and _lowest(w, walkers):
            extend_seed(w, walkers, used)
        elif not stage.crowded and w.cur is None and w.kicks % 2 == 0:
            cross_seed(w, walkers, stage.tried)
    return None


def _take(hits: list[list[int]], pending: list[list[int]]) -> list[int] | None:
    """The first exact sentence a seed pass found (None: none); the others wait in `pending`."""
    if not hits:
        return None
    pending.extend(hits[1:])
    return hits[0]


def _lowest(w: Walker, walkers: list[Walker]) -> bool:
    """Whether `w`'s best objective per position is the lowest of every length's."""
    assert w.best is not None
    return all(v.best is None or w.best[0] / w.n <= v.best[0] / v.n for v in walkers)


def extend_seed(w: Walker, walkers: list[Walker], used: list[float]) -> None:
    """A graded walk's new best, the lowest per position of every length, is often a batch
    sentence but for its end: the prefix of a sentence one or two tokens longer, closed early, or
    a sentence with one token too many (e.g. a walk of length n settled on a sentence of n + 1
    tokens without its last one, which no move of its own length reaches). Its content restarts the walks of lengths n - 1, n + 1 and
    n + 2 (their other positions keep their own best tokens), and those run next."""
    assert w.best is not None
    content = w.best[2][0, 1:-1].tolist()
    low = min(used)
    for k, v in enumerate(walkers):
        if v.n in (w.n - 1, w.n + 1, w.n + 2):
            v.restart(content)
            used[k] = low


def _gate(stage: Stage, tol2: float) -> float:
    """The prefix seeds' layer-2 gate before the exact check: the stage's own, else the search's."""
    return tol2 if stage.tol2 is None else stage.tol2


def cross_seed(w: Walker, walkers: list[Walker], tried: set[tuple[int, tuple[int, ...]]]) -> bool:
    """Every other kick of an uncrowded walk: instead of the random kick, start from its best
    sentence overwritten by another length's best content (its prefix, or the whole of a shorter
    one), lowest objective per position first, each source once per length. The trap this leaves:
    a walk of length n settled on the prefix of a longer sentence of the batch (a deep local
    minimum of the layer-2 distance) while the length n - 1 walk holds the true length-n sentence
    but one token; without the cross seed such a walk stays on the longer sentence's prefix."""
    if w.best is None:
        return False
    sources = sorted(
        (v.best[0] / v.n, k, v.best[2][0, 1:-1].tolist())
        for k, v in enumerate(walkers)
        if v is not w and v.best is not None and v.n > 2
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


def stage_report(stage: Stage, left: int, hit: list[int] | None, seconds: float) -> dict[str, Any]:
    """What one stage did: ranks, hypotheses, rounds, the busiest lengths' work and sweeps."""
    busiest = sorted(zip(stage.walkers, stage.used), key=lambda x: -x[1])[:6]
    return {
        "left": left,
        "rank1": stage.rank1,
        "rank2": stage.rank2,
        "objective": stage.objective,
        "hypotheses": len(stage.walkers),
        "rounds": stage.rounds,
        "scored": stage.scored,
        "suffix_hits": len(stage.grower.hits) if stage.grower is not None else None,
        "seconds": round(seconds, 1),
        "length": len(hit) if hit else None,
        "lengths": [w.n for w in stage.walkers],
        "work_by_length": {w.n: int(u) for w, u in busiest},
        "sweeps_by_length": {w.n: w.sweeps for w, _ in busiest},
    }


def best_guesses(stage: Stage) -> list[list[int]]:
    """The walkers' best sentences, lowest objective per position first, then where a walker has
    none yet (the search stopped before it settled) the sentence it stands at (unsolved sentences' guesses)."""
    scored = [(w.best[0] / w.n, k, w.best[2][0].tolist()) for k, w in enumerate(stage.walkers) if w.best is not None]
    unsettled = [w.x[0].tolist() for w in stage.walkers if w.best is None]
    return [s for _, _, s in sorted(scored, key=lambda x: (x[0], x[1]))] + unsettled


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
    check of the residual (`CLSCheck`), the walkers of its length hypotheses (`setup_stage`), a
    fair-share search until one sentence passes (`search_stage`), then that sentence is subtracted
    (`Residual.peel`) and the next stage starts from the new residual. `cands_of(span1)` gives the
    per-position candidates of a layer-1 span. Returns None if the check does not apply.

    Work, never time, orders and bounds the search, so the result does not depend on the machine
    or its load: `opts.sentences(B)` caps the candidate sentences scored (all stages together) and
    `opts.work` x the batch size the block-rows their scoring computed (`veil.attacks.span.work`: what tracks the time a
    search takes); a hypothesis' work is the tokens it scored plus `CALL_COST` per scoring call.
    Where that would be passed the stage stops there and the search returns what it has: the
    exact sentences found and the best guesses of the stage it was in.

    With `suffix`, stages grow every length's sentence from its end (`veil.attacks.span.suffix`):
    MLP stages first or after the prefix seeds, uncrowded layer-2 stages after prefix seeds that
    found none, as `Growth` decides; the exact ones found beside the one peeled wait in `pending`
    for the next stages."""
    start = time.perf_counter()
    rng = np.random.default_rng(seed)
    found: list[list[int]] = []
    labels: list[int] = []
    steps = rounds = 0
    reports: list[dict[str, Any]] = []
    guesses: list[list[int]] = []
    carried: dict[int, list[int]] = {}  # per length, the best sentence of the previous stage's walker
    pending: list[list[int]] = []  # exact sentences found beside the one peeled (`veil.attacks.span.prefix`)
    grown: dict[int, int] = {}  # first tokens the prefix seeds grew from, and how often
    note = None
    growth = Growth(on=opts.suffix_seeds)
    budget = opts.sentences(res.batch_size)
    bar = work_bar(budget, "span")  # sentences scored, all stages; shown where `attack_progress` is on
    done = [0]  # sentences scored by the stages before the current one
    meter = Meter(limit=opts.work * res.batch_size)

    def progress(s: Stage) -> None:
        bar.update(done[0] + s.scored - bar.n)

    while res.left > 0 and steps < budget:
        check = exact_check(res, opts)
        if not check.usable:
            if not found:
                return None
            break
        t0 = time.perf_counter()
        stage = setup_stage(
            res,
            check,
            cands_of,
            specials,
            rng,
            carried,
            opts,
        )
        stage.tick = partial(progress, stage)
        stage.score.meter = meter
        if not stage.walkers:
            reports.append(stage_report(stage, res.left, None, time.perf_counter() - t0))
            note = None if found else "no token passes layer 1 (dropout or noise? raise tol1)"
            break
        try:
            hit = search_stage(stage, specials, carried, budget - steps, seeds, pending, grown, growth)
        except WorkSpent:  # the block-row budget: this stage's best guesses stand for the sentences left
            hit = None
            for w in stage.walkers:
                w.hold()
        steps += stage.scored
        rounds += stage.rounds
        done[0] = steps
        bar.update(steps - bar.n)
        bar.set_postfix(exact=len(found) + (hit is not None), block_rows=meter.done, refresh=False)
        reports.append(stage_report(stage, res.left, hit, time.perf_counter() - t0))
        if hit is None:
            guesses = best_guesses(stage)
            break
        carried = {w.n: w.best[2][0].tolist() for w in stage.walkers if w.best is not None}
        carried = {n: s for n, s in carried.items() if s != hit}
        label, _ = res.peel(hit, check)
        found.append(hit)
        labels.append(label)
    bar.close()
    exact = found + [s for s in pending if s not in found]  # exact sentences found but not yet peeled, too
    seqs = exact + guesses[: max(0, res.batch_size - len(exact))]  # unsolved: the best guesses
    seqs += [[] for _ in range(res.batch_size - len(seqs))]  # no guess: an empty sentence (scored, not skipped)
    info = {
        "sentences_exact": len(found),
        "walker_steps": rounds,
        "sentences_scored": steps,
        "block_rows": meter.done,
        "work_stopped": meter.stopped,
        "stages": reports,
        "labels_inferred": labels,
        "search_seconds": time.perf_counter() - start,
    }
    return seqs, ({"note": note, **info} if note else info)


def _merit(w: Walker, share: float, crowded: bool) -> float:
    """A hypothesis' claim on work: its share, and in a crowded span also the inverse of its best
    objective per position so far (the true sentence's is well below a wrong local minimum's),
    so the walks closest to a solution run most."""
    if not crowded or w.best is None:
        return share
    return share / max(w.best[0] / w.n, 0.02)


def _shares(walkers: list[Walker], where: PositionPrior, sep: int | None) -> list[float]:
    """Work shares of the length hypotheses when every length passes layer 1 (a crowded span):
    0.1 + the position prior's coefficient of [SEP] at the hypothesis' last position, so the
    lengths where the position gradient puts a [SEP] are searched first (the true ends get clearly
    larger coefficients than the other positions)."""
    if where.cost is None or sep is None:
        return [1.0] * len(walkers)
    T = where.cost.shape[0]
    return [0.1 + (float((1 - where.cost[w.n - 1, sep]).clamp(0, 1)) if w.n - 1 < T else 0.0) for w in walkers]


def length_walkers(cands: list[Tensor], specials: Specials, rng: np.random.Generator, kick: int) -> list[Walker]:
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
        out.append(Walker([first, *content, last], rng, kick=kick))
    return out
