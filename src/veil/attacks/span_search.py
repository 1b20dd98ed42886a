"""Sequence search of the span attack (Petrov et al. 2024, DAGER sec. 4): from the per-position
candidate tokens that pass the first layer's span check, rebuild whole sentences with the second
layer's span check ``d(h1) < tol2``, where h1 is the input of attention layer 2 computed by
running the first block on a candidate sentence.

Decoder (causal; DAGER alg. 1): h1 at position t depends only on tokens <= t, so prefixes are
extended greedily one position at a time; an extension survives if its last h1 is in the span.
A prefix with no surviving extension has ended. A causal LM's last token ([SEP]) is never
scored, so it gets no gradient: the attacker appends the tokenizer's [SEP] to every ended prefix.

Encoder (bidirectional): h1 at every position depends on the whole sentence, so prefixes cannot
be checked exactly. Sentence lengths come from the positions where [SEP] passes layer 1 (a
multiset hypothesis of B lengths, checked against the candidate counts); then an assignment
search: each position's candidate tokens are distributed over the sentences alive there, and
coordinate sweeps re-assign one position at a time by a covering assignment (Hungarian) that
minimises the sentences' summed layer-2 distances, with random restarts. The true batch is the
unique zero of that cost when B*T < width.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment
from torch import Tensor

from veil.attacks.span import Span, layer_inputs
from veil.models.base import VeilModel


def sentence_costs(model: VeilModel, span2: Span, ids: Tensor, mask: Tensor) -> Tensor:
    """Per-position layer-2 span distance (N, T) of sentences `ids`; 0 at padding."""
    return span2.distance(layer_inputs(model, ids, mask)).float() * mask


def _last_position(cands: list[Tensor]) -> int:
    nonempty = [t for t, c in enumerate(cands) if len(c)]
    return nonempty[-1] + 1 if nonempty else 0


# ----------------------------------------------------------------------------- decoder
def decoder_search(model: VeilModel, span2: Span, cands: list[Tensor], specials: Any, *, tol2: float, seed: int,
                   batch_size: int | None, beam: int | None = None) -> tuple[list[list[int]], dict[str, Any]]:
    """Greedy left-to-right extension of prefixes (see the module docstring)."""
    T = _last_position(cands)
    B = batch_size or max((len(c) for c in cands), default=1)
    beam = int(beam or 4 * B)
    active: list[list[int]] = [[]]
    scores: list[float] = [0.0]
    finished: list[tuple[list[int], float]] = []
    tested = 0
    for t in range(T):
        toks = cands[t].tolist()
        ext = [p + [v] for p in active for v in toks]
        if not ext:
            break
        ids = torch.tensor(ext)
        d = sentence_costs(model, span2, ids, torch.ones_like(ids))[:, -1]
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
class _Layout:
    """A length hypothesis: per sentence its length and whether its last slot holds [SEP]."""

    lengths: list[int]
    sep_end: list[bool]

    def continuing(self, t: int) -> list[int]:
        """Sentences holding a content token at position t."""
        return [b for b, (n, s) in enumerate(zip(self.lengths, self.sep_end)) if t < n and not (s and t == n - 1)]


def length_layouts(sets: list[list[int]], sep: int | None, B: int, limit: int = 3) -> list[_Layout]:
    """Plausible length multisets: every [SEP] position used at least once, ranked by how well the
    number of sentences alive at each position covers that position's candidate count."""
    T = len(sets)
    ends = [(t + 1, True) for t in range(T) if sep is not None and sep in sets[t]]
    content = [[v for v in s if v != sep] for s in sets]
    if content and content[-1]:
        ends.append((T, False))  # sentences cut at the maximum length carry no [SEP]
    if not ends:
        return [_Layout([T] * B, [False] * B)]
    ends = ends[-B:] if len(ends) > B else ends
    layouts = []
    for extra in itertools.combinations_with_replacement(range(len(ends)), B - len(ends)):
        chosen = [ends[i] for i in range(len(ends))] + [ends[i] for i in extra]
        lay = _Layout([c[0] for c in chosen], [c[1] for c in chosen])
        need = np.array([len(c) for c in content])
        have = np.array([len(lay.continuing(t)) for t in range(T)])
        layouts.append(((np.maximum(need - have, 0).sum(), (have - need).clip(min=0).sum()), lay))
        if len(layouts) > 5000:
            break
    layouts.sort(key=lambda x: x[0])
    return [lay for _, lay in layouts[:limit]]


def _initial(lay: _Layout, content: list[list[int]], sets: list[list[int]], sep: int | None, pad: int,
             rng: np.random.Generator) -> Tensor:
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


def _assign(cost: np.ndarray) -> np.ndarray:
    """Column index per row: each of the m tokens used at least once when n >= m (covering)."""
    n, m = cost.shape
    if n >= m:
        free = np.repeat(cost.min(axis=1, keepdims=True), n - m, axis=1)
        rows, cols = linear_sum_assignment(np.concatenate([cost, free], axis=1))
        out = np.empty(n, dtype=np.int64)
        out[rows] = np.where(cols < m, cols, cost.argmin(axis=1)[rows])
        return out
    rows, cols = linear_sum_assignment(cost)
    out = np.empty(n, dtype=np.int64)
    out[rows] = cols
    return out


def _sweep(model: VeilModel, span2: Span, ids: Tensor, mask: Tensor, lay: _Layout, content: list[list[int]],
           rng: np.random.Generator) -> tuple[bool, int]:
    """One pass over ambiguous positions; returns whether anything changed and sentences scored."""
    changed, scored = False, 0
    positions = [t for t in range(ids.shape[1]) if len(content[t]) > 1 or (len(content[t]) == 1 and len(lay.continuing(t)) > 0)]
    for t in rng.permutation(positions).tolist():
        conts, toks = lay.continuing(t), content[t]
        if not conts or not toks or (len(toks) == 1 and all(int(ids[b, t]) == toks[0] for b in conts)):
            continue
        variants = ids[conts].repeat_interleave(len(toks), dim=0)
        variants[:, t] = torch.tensor(toks).repeat(len(conts))
        vmask = mask[conts].repeat_interleave(len(toks), dim=0)
        cost = sentence_costs(model, span2, variants, vmask).sum(1).view(len(conts), len(toks)).double().numpy()
        scored += len(variants)
        pick = _assign(cost)
        for b, j in zip(conts, pick.tolist()):
            if int(ids[b, t]) != toks[j]:
                ids[b, t] = toks[j]
                changed = True
    return changed, scored


def encoder_search(model: VeilModel, span2: Span, cands: list[Tensor], specials: Any, *, tol2: float, seed: int,
                   batch_size: int | None, restarts: int = 4, sweeps: int = 12) -> tuple[list[list[int]], dict[str, Any]]:
    """Length hypotheses x random restarts x coordinate sweeps (see the module docstring)."""
    T = _last_position(cands)
    sets = [c.tolist() for c in cands[:T]]
    sep, pad = specials.sep, specials.pad if specials.pad is not None else 0
    content = [[v for v in s if v != sep] for s in sets]
    B = batch_size or max([len(s) for s in sets] + [1])
    rng = np.random.default_rng(seed)
    best: tuple[float, Tensor, Tensor] | None = None
    scored = tries = 0
    for lay in length_layouts(sets, sep, B):
        mask = (torch.arange(max(lay.lengths))[None] < torch.tensor(lay.lengths)[:, None]).long()
        for _ in range(max(1, restarts)):
            ids = _initial(lay, content, sets, sep, pad, rng)
            tries += 1
            for _ in range(sweeps):
                changed, n = _sweep(model, span2, ids, mask, lay, content, rng)
                scored += n
                if not changed:
                    break
            dist = sentence_costs(model, span2, ids, mask)
            score = float(dist.sum() / mask.sum())
            if best is None or score < best[0]:
                best = (score, ids.clone(), mask)
            if float(dist.max()) < tol2:
                break
        if best is not None and float(sentence_costs(model, span2, best[1], best[2]).max()) < tol2:
            break  # an exact solution: every position of every sentence lies in the layer-2 span
    if best is None:
        return [], {"sentences_scored": 0}
    score, ids, mask = best
    seqs = [ids[b, : int(mask[b].sum())].tolist() for b in range(ids.shape[0])]
    return seqs, {"sentences_scored": scored, "restarts_run": tries, "mean_layer2_distance": score,
                  "exact": bool(float(sentence_costs(model, span2, ids, mask).max()) < tol2), "batch_size_used": B}
