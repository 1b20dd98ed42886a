"""Sequence search of the span attack (Petrov et al. 2024, DAGER sec. 4): from the per-position
candidate tokens that pass the first layer's span check, rebuild whole sentences with the second
layer's span check ``d(h1) < tol2``, where h1 is the input of attention layer 2 computed by
running the first block on a candidate sentence.

Decoder (causal; DAGER alg. 1): h1 at position t depends only on tokens <= t, so prefixes are
extended greedily one position at a time; an extension survives if its last h1 is in the span.
That row alone is computed, through block 1 with the prefix's keys and values computed once
(`veil.attacks.span.causal`).
A prefix with no surviving extension has ended. A causal LM's last token ([SEP]) is never
scored, so it gets no gradient: the attacker appends the tokenizer's [SEP] to every ended prefix.

Encoder (bidirectional): h1 at every position depends on the whole sentence, so prefixes cannot
be checked exactly. Sentence lengths: hypotheses of B lengths ending where [SEP] passes layer 1,
bounded below by the tokens pinned to each position (shortest first). Then an assignment search:
each position's candidate tokens are distributed over the sentences alive there, and coordinate
sweeps re-assign one position at a time by an assignment (Hungarian) that minimises the
sentences' summed layer-2 distances, every pinned token used at least once. A sentence whose
every position lies in the layer-2 span is exact (its cost does not depend on the others): it is
frozen and carried over to later restarts and length hypotheses, which run round robin. The
true batch is the unique zero of that cost when B*T < width.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment
from torch import Tensor

from veil.attacks.span.causal import LastRowScorer
from veil.attacks.span.core import ACT_FLOATS, Span, Specials, last_position, layer_inputs, rows_per_call
from veil.attacks.span.options import SpanOptions
from veil.models.base import VeilModel


@dataclass(frozen=True)
class SearchInput:
    """What a whole-sentence search starts from (the decoder's and the encoder's alike): the model
    and its layer-2 span, each position's layer-1 candidate tokens, the tokenizer's special ids,
    the layer-2 tolerance and the batch size (None: the most candidates at one position)."""

    model: VeilModel
    span2: Span
    cands: list[Tensor]
    specials: Specials
    tol2: float
    batch_size: int | None


def sentence_costs(model: VeilModel, span2: Span, ids: Tensor, mask: Tensor) -> Tensor:
    """Per-position layer-2 span distance (N, T) of sentences `ids`; 0 at padding. Scored in calls
    sized to memory (`rows_per_call`): a sweep may hold every token of the vocabulary at one
    position (layer 1 admits them all once its span is full, e.g. under DP-SGD noise)."""
    rows = rows_per_call(model, ids.shape[1] * span2.width * 2 * ACT_FLOATS * 4)
    with torch.no_grad():
        parts = [
            span2.distance(layer_inputs(model, ids[i : i + rows], mask[i : i + rows])).float().cpu()
            for i in range(0, len(ids), rows)
        ]
    return torch.cat(parts) * mask if parts else torch.zeros(ids.shape) * mask


# ----------------------------------------------------------------------------- decoder
def decoder_search(
    inp: SearchInput, *, beam: int | None, per_sentence: int, budget: int
) -> tuple[list[list[int]], dict[str, Any]]:
    """Greedy left-to-right extension of prefixes (see the module docstring), keeping `beam`
    prefixes per position (None: `per_sentence` per batch sentence); stops extending once `budget`
    prefixes are scored (a position's extensions are cut at what is left of it)."""
    model, span2, cands, specials, tol2 = inp.model, inp.span2, inp.cands, inp.specials, inp.tol2
    T = last_position(cands)
    if T == 0:
        return [], {"prefixes_tested": 0, "note": "no token passes layer 1 (dropout or noise? raise tol1)"}
    B = inp.batch_size or max((len(c) for c in cands), default=1)
    beam = int(beam or per_sentence * B)
    score = LastRowScorer(model, span2)  # the last position's layer-2 distance, one row through block 1
    active: list[list[int]] = [[]]
    scores: list[float] = [0.0]
    finished: list[tuple[list[int], float]] = []
    tested = 0
    for t in range(T):
        toks = cands[t].tolist()
        ext = [p + [v] for p in active for v in toks][: budget - tested]  # never past the budget
        if not ext:
            break
        d = score(torch.tensor(active, dtype=torch.long), cands[t], len(ext))
        tested += len(ext)
        parent = torch.arange(len(active)).repeat_interleave(len(toks))
        keep = torch.nonzero(d < tol2).flatten()
        keep = keep[d[keep].argsort()][:beam]
        alive = set(parent[keep].tolist())
        finished += [(p, s) for i, (p, s) in enumerate(zip(active, scores)) if i not in alive and p]
        active = [ext[i] for i in keep.tolist()]
        scores = [max(scores[int(parent[i])], float(d[i])) for i in keep.tolist()]
        if not active:
            break
    finished += [(p, s) for p, s in zip(active, scores) if p]
    finished.sort(key=lambda x: x[1])
    seqs = [p + ([specials.sep] if specials.sep is not None and len(p) < len(cands) else []) for p, _ in finished[:B]]
    return seqs, {"prefixes_tested": tested, "sentences_found": len(finished), "batch_size_used": B}


# ----------------------------------------------------------------------------- encoder
@dataclass
class Layout:
    """A length hypothesis: per sentence its length and whether its last slot holds [SEP]."""

    lengths: list[int]
    sep_end: list[bool]

    def continuing(self, t: int) -> list[int]:
        """Sentences holding a content token at position t."""
        return [b for b, (n, s) in enumerate(zip(self.lengths, self.sep_end)) if t < n and not (s and t == n - 1)]


def length_layouts(
    sets: list[list[int]], sep: int | None, B: int, pins: dict[int, int] | None, *, limit: int, reach: int
) -> list[Layout]:
    """Plausible sentence lengths, shortest first. The longest sentence ends at the last position
    with candidates (later positions get no gradient). A token pinned to position t (see
    `veil.attacks.span.core.pin_positions`) is content of a sentence longer than t + 1, so the k-th
    longest sentence is at least ``max{t + 2 : k tokens pinned at t}`` long; each sentence ends
    where [SEP] passes layer 1. Each of the other B - 1 lengths takes one of the first `reach`
    [SEP] positions at or above its bound; combinations are ranked by total extension."""
    T = len(sets)
    if sep is None or B < 1:
        return [Layout([T] * max(B, 1), [False] * max(B, 1))]
    need = np.zeros(T, dtype=np.int64)
    for v, t in (pins or {}).items():
        if v != sep and t < T:
            need[t] += 1
    bound = [max([t + 2 for t in range(T) if need[t] >= k] + [2]) for k in range(1, B + 1)]
    ends = [t + 1 for t in range(T) if sep in sets[t]]
    if not ends:
        return [Layout([T] * B, [False] * B)]
    longest = T if T in ends else ends[-1]
    options = [[e for e in ends if e >= bound[k]][:reach] or [longest] for k in range(1, B)]
    layouts = []
    for combo in itertools.product(*options) if options else [()]:
        lengths = sorted([longest, *combo], reverse=True)
        if lengths[0] != longest:
            continue
        layouts.append((sum(lengths), lengths))
    seen, out = set(), []
    for _, lengths in sorted(layouts):
        if tuple(lengths) not in seen:
            seen.add(tuple(lengths))
            out.append(Layout(lengths, [True] * B))
    return out[:limit]


def initial_ids(
    lay: Layout, content: list[list[int]], sets: list[list[int]], sep: int | None, pad: int, rng: np.random.Generator
) -> Tensor:
    B, T = len(lay.lengths), max(lay.lengths)
    ids = torch.full((B, T), pad, dtype=torch.long)
    for b, (n, s) in enumerate(zip(lay.lengths, lay.sep_end)):
        if s:
            ids[b, n - 1] = sep
    for t in range(T):
        conts = lay.continuing(t)
        toks = content[t] or sets[t] or [pad]
        order = rng.permutation(len(conts))
        for j, b in enumerate(np.array(conts)[order].tolist()):
            ids[b, t] = toks[j] if j < len(toks) else toks[int(rng.integers(len(toks)))]
    return ids


def assign(cost: np.ndarray, required: np.ndarray) -> np.ndarray:
    """Column index per row minimising the summed cost, every `required` column (a pinned token,
    certainly at this position) used at least once; other columns are optional and may repeat."""
    n, m = cost.shape
    req = np.flatnonzero(required)
    if len(req) > n:  # more pinned tokens than sentences: keep the cheapest distinct ones
        rows, cols = linear_sum_assignment(cost[:, req])
        out = np.empty(n, dtype=np.int64)
        out[rows] = req[cols]
        return out
    free = np.repeat(cost.min(axis=1, keepdims=True), n - len(req), axis=1)
    rows, cols = linear_sum_assignment(np.concatenate([cost[:, req], free], axis=1))
    out = np.empty(n, dtype=np.int64)
    best = cost.argmin(axis=1)
    out[rows] = [req[c] if c < len(req) else best[r] for r, c in zip(rows.tolist(), cols.tolist())]
    return out


def sweep(
    model: VeilModel,
    span2: Span,
    ids: Tensor,
    mask: Tensor,
    lay: Layout,
    content: list[list[int]],
    rng: np.random.Generator,
    pinned: set[int],
    frozen: set[int],
    limit: int | None = None,
) -> tuple[bool, int]:
    """One pass over ambiguous positions re-assigning the unsolved sentences' tokens; returns whether
    anything changed and how many sentences were scored. Never scores more than `limit` sentences
    (the search's budget left): where a position's variants do not fit, the first ones that do are
    scored, only the sentences scored with every candidate are re-assigned, and the pass ends."""
    changed, scored = False, 0
    for t in rng.permutation(ids.shape[1]).tolist():
        if limit is not None and scored >= limit:
            break
        conts, toks = [b for b in lay.continuing(t) if b not in frozen], content[t]
        if not conts or not toks or (len(toks) == 1 and all(int(ids[b, t]) == toks[0] for b in conts)):
            continue
        held = {int(ids[b, t]) for b in frozen if b in lay.continuing(t)}
        room = len(conts) * len(toks) if limit is None else min(len(conts) * len(toks), limit - scored)
        variants = ids[conts].repeat_interleave(len(toks), dim=0)[:room]
        variants[:, t] = torch.tensor(toks).repeat(len(conts))[:room]
        vmask = mask[conts].repeat_interleave(len(toks), dim=0)[:room]
        costs = sentence_costs(model, span2, variants, vmask).sum(1)
        scored += len(variants)
        conts = conts[: room // len(toks)]  # the sentences whose every candidate was scored
        if not conts:
            break
        cost = costs[: len(conts) * len(toks)].view(len(conts), len(toks)).double().numpy()
        pick = assign(cost, np.array([v in pinned and v not in held for v in toks]))
        for b, j in zip(conts, pick.tolist()):
            if int(ids[b, t]) != toks[j]:
                ids[b, t] = toks[j]
                changed = True
    return changed, scored


def solved_rows(model: VeilModel, span2: Span, ids: Tensor, mask: Tensor, tol2: float) -> set[int]:
    """Sentences whose every position lies in the layer-2 span: exact (the rest of the batch cannot change them)."""
    return set(torch.nonzero(sentence_costs(model, span2, ids, mask).amax(1) < tol2).flatten().tolist())


def carry(ids: Tensor, lay: Layout, kept: list[list[int]]) -> set[int]:
    """Copy already solved sentences into rows of the same length; returns those rows."""
    rows: set[int] = set()
    for sent in kept:
        free = [b for b, n in enumerate(lay.lengths) if n == len(sent) and b not in rows]
        if free:
            ids[free[0], : len(sent)] = torch.tensor(sent)
            rows.add(free[0])
    return rows


def encoder_search(
    inp: SearchInput,
    opts: SpanOptions,
    *,
    seed: int,
    pins: dict[int, int] | None = None,
    budget: int,
) -> tuple[list[list[int]], dict[str, Any]]:
    """Length hypotheses (``opts.layouts``, each length at one of ``opts.layout_reach`` [SEP]
    positions) x restarts (``opts.restarts``, round robin) x coordinate sweeps (``opts.sweeps``);
    solved sentences are frozen and carried across restarts and layouts (see the module
    docstring). `budget` caps the candidate sentences scored (counted work, never time: the
    result does not depend on the machine's load)."""
    start = time.perf_counter()
    T = last_position(inp.cands)
    if T == 0:
        return [], {"sentences_scored": 0, "note": "no token passes layer 1 (dropout or noise? raise tol1)"}
    run = _Restarts.of(inp, T, seed, pins, budget)
    layouts = length_layouts(run.sets, run.sep, run.B, pins, limit=opts.layouts, reach=opts.layout_reach)
    for lay in (lay for _ in range(max(1, opts.restarts)) for lay in layouts):  # one restart per layout, round robin
        if run.restart(lay, opts.sweeps):
            break  # an exact solution (every position of every sentence in the layer-2 span), or the budget spent
    return run.result(start)


@dataclass
class _Restarts:
    """What the encoder search's restarts share: each position's candidates (`sets`; `content`
    without [SEP], pinned tokens first), the batch size, the draws, the solved sentences carried
    over (`kept`), the best assignment so far (fewest unsolved sentences, then the least mean
    layer-2 distance) and the sentences scored against `budget`."""

    inp: SearchInput
    sets: list[list[int]]
    content: list[list[int]]
    pinned: set[int]
    B: int
    rng: np.random.Generator
    budget: int
    kept: list[list[int]] = field(default_factory=list)
    best: tuple[tuple[int, float], Tensor, Tensor] | None = None
    scored: int = 0
    tries: int = 0

    @classmethod
    def of(cls, inp: SearchInput, T: int, seed: int, pins: dict[int, int] | None, budget: int) -> _Restarts:
        sets = [c.tolist() for c in inp.cands[:T]]
        B = inp.batch_size or max([len(s) for s in sets] + [1])
        rng = np.random.default_rng(seed)
        pinned = set(pins or {})
        sep = inp.specials.sep
        content = [sorted((v for v in s if v != sep), key=lambda v: v not in pinned) for s in sets]  # pinned first
        return cls(inp, sets, content, pinned, B, rng, budget)

    @property
    def sep(self) -> int | None:
        return self.inp.specials.sep

    @property
    def pad(self) -> int:
        return self.inp.specials.pad if self.inp.specials.pad is not None else 0

    def restart(self, lay: Layout, sweeps: int) -> bool:
        """One restart on length hypothesis `lay`: a random start with the kept sentences carried
        in, up to `sweeps` sweeps; True where every sentence is solved or the budget is spent."""
        model, span2 = self.inp.model, self.inp.span2
        mask = (torch.arange(max(lay.lengths))[None] < torch.tensor(lay.lengths)[:, None]).long()
        ids = initial_ids(lay, self.content, self.sets, self.sep, self.pad, self.rng)
        frozen = carry(ids, lay, self.kept)
        self.tries += 1
        self._sweeps(ids, mask, lay, frozen, sweeps)
        solved = [ids[b, : lay.lengths[b]].tolist() for b in sorted(frozen)]
        self.kept += [x for x in solved if x not in self.kept]
        dist = sentence_costs(model, span2, ids, mask)
        key = (-len(frozen), float(dist.sum() / mask.sum()))
        if self.best is None or key < self.best[0]:
            self.best = (key, ids.clone(), mask)
        return len(frozen) == self.B or self.scored >= self.budget

    def _sweeps(self, ids: Tensor, mask: Tensor, lay: Layout, frozen: set[int], sweeps: int) -> None:
        """Coordinate sweeps until one changes nothing, every sentence is solved (`frozen`, grown
        in place) or the budget is spent."""
        model, span2 = self.inp.model, self.inp.span2
        for _ in range(sweeps):
            left = self.budget - self.scored
            changed, n = sweep(model, span2, ids, mask, lay, self.content, self.rng, self.pinned, frozen, left)
            self.scored += n
            frozen |= solved_rows(model, span2, ids, mask, self.inp.tol2)
            if not changed or len(frozen) == self.B or self.scored >= self.budget:
                break

    def result(self, start: float) -> tuple[list[list[int]], dict[str, Any]]:
        """The best assignment's sentences and the search's stats."""
        if self.best is None:
            return [], {"sentences_scored": 0}
        (_, score), ids, mask = self.best
        model, span2 = self.inp.model, self.inp.span2
        seqs = [ids[b, : int(mask[b].sum())].tolist() for b in range(ids.shape[0])]
        return seqs, {
            "sentences_scored": self.scored,
            "restarts_run": self.tries,
            "mean_layer2_distance": score,
            "sentences_exact": len(solved_rows(model, span2, ids, mask, self.inp.tol2)),
            "batch_size_used": self.B,
            "search_seconds": time.perf_counter() - start,
        }
