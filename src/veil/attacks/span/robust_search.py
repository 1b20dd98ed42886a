"""Layer 2 of `span-robust` (see `veil.attacks.span.robust` for the paper, the equations and what the
attacker knows): order the (token, position) pairs that passed the robust layer-1 test into
sentences. Under client dropout layer 2's input is perturbed densely (attention-probability and
hidden dropout inside block 0), so the clean model's layer-2 span distance is a ranking here, not
a test: encoders by an assignment search over length hypotheses plus pairwise exchanges
(`encoder_assign`, `refine`), causal decoders left to right (`decoder_assign`, DAGER alg. 1 with
an assignment instead of a threshold). Every passing pair is a true pair, so each must be used.
"""

from __future__ import annotations

import itertools
from typing import Protocol

import numpy as np
import torch
from torch import Tensor

from veil.attacks.span.core import Span, Specials, last_position
from veil.attacks.span.search import Layout, assign, initial_ids, length_layouts, sentence_costs, sweep
from veil.models.base import VeilModel


def coverage_pins(cands: list[Tensor], specials: Specials) -> dict[int, int]:
    """Every content token that passed the robust layer-1 test is a true (token, position) pair,
    so each must be used by some sentence: the encoder search's pins (each pinned token is
    assigned to at least one sentence wherever it is a candidate; the counts of pinned tokens per
    position bound the sentence lengths from below)."""
    special = {v for v in (specials.cls, specials.sep, specials.pad) if v is not None}
    pins: dict[int, int] = {}
    for t, c in enumerate(cands):
        for v in c.tolist():
            if v not in special:
                pins.setdefault(int(v), t)
    return pins


# ----------------------------------------------------------------------------- layer-2 refinement
#: sentences per layer-2 scoring call of the refinement: a bound on one call's memory, not a tunable
COST_CHUNK = 256
#: a refinement move must lower the summed layer-2 distance by more than float rounding
MIN_GAIN = 1e-9


def _pad(seqs: list[list[int]], pad: int) -> tuple[Tensor, Tensor]:
    T = max(len(x) for x in seqs)
    ids = torch.full((len(seqs), T), pad, dtype=torch.long)
    mask = torch.zeros(len(seqs), T, dtype=torch.long)
    for b, x in enumerate(seqs):
        ids[b, : len(x)] = torch.tensor(x, dtype=torch.long)
        mask[b, : len(x)] = 1
    return ids, mask


def _costs(model: VeilModel, span2: Span, seqs: list[list[int]], pad: int, chunk: int = COST_CHUNK) -> Tensor:
    """Summed layer-2 span distance of each sentence (the clean model's layer-2 input)."""
    out = []
    for i in range(0, len(seqs), chunk):
        ids, mask = _pad(seqs[i : i + chunk], pad)
        out.append(sentence_costs(model, span2, ids, mask).double().sum(1))
    return torch.cat(out)


def refine(model: VeilModel, span2: Span, seqs: list[list[int]], pad: int, sweeps: int) -> tuple[list[list[int]], int]:
    """Pairwise moves the position-wise assignment search cannot make: for two sentences and a
    cut t, exchange their tails from t on, or exchange their tokens at t alone. Each keeps the
    tokens at every position (the layer-1 pairs), so only layer 2 decides; the move that lowers
    the two sentences' summed layer-2 distance most is taken, until none does or `sweeps` rounds
    have run. Returns the sentences and how many were scored."""
    seqs = [list(x) for x in seqs]
    scored = 0
    cost = _costs(model, span2, seqs, pad)
    for _ in range(sweeps):
        moves, pairs = [], []
        for a in range(len(seqs)):
            for b in range(a + 1, len(seqs)):
                x, y = seqs[a], seqs[b]
                for t in range(1, min(len(x), len(y))):
                    if x[t:] != y[t:]:
                        moves += [(a, b), (a, b)]
                        pairs += [x[:t] + y[t:], y[:t] + x[t:]]
                    if x[t] != y[t] and t < min(len(x), len(y)) - 1:
                        moves += [(a, b), (a, b)]
                        pairs += [x[:t] + [y[t]] + x[t + 1 :], y[:t] + [x[t]] + y[t + 1 :]]
        if not pairs:
            break
        c = _costs(model, span2, pairs, pad).view(-1, 2).sum(1)
        scored += len(pairs)
        base = torch.tensor([float(cost[a] + cost[b]) for a, b in moves[::2]], dtype=torch.float64)
        gain = base - c
        j = int(gain.argmax())
        if float(gain[j]) <= MIN_GAIN:
            break
        a, b = moves[2 * j]
        seqs[a], seqs[b] = pairs[2 * j], pairs[2 * j + 1]
        cost[a], cost[b] = _costs(model, span2, [seqs[a], seqs[b]], pad)
    return seqs, scored


class Assignment(Protocol):
    """The encoder assignment search's settings (`SpanRobustOptions` holds them)."""

    restarts: int
    sweeps: int
    refine: int
    layouts: int
    layout_pool: int


def sentence_layouts(
    cands: list[Tensor], specials: Specials, B: int, pins: dict[int, int], o: Assignment
) -> list[Layout]:
    """Length hypotheses (`veil.attacks.span.search.length_layouts`, shortest first; the first
    ``o.layout_pool``, each sentence's length at any [SEP] position) that end a sentence at every
    position where [SEP] passed layer 1 (those pairs are true); all of them if none does; the
    first ``o.layouts`` of them."""
    sets = [c.tolist() for c in cands]
    lays = length_layouts(sets, specials.sep, B, pins, limit=o.layout_pool, reach=B)
    seps = {t + 1 for t, c in enumerate(sets) if specials.sep in c}
    full = [lay for lay in lays if seps <= set(lay.lengths)]
    return (full or lays)[: o.layouts]


def encoder_assign(
    model: VeilModel, span2: Span, cands: list[Tensor], specials: Specials, B: int, *, seed: int, o: Assignment
) -> tuple[list[list[int]], dict[str, object]]:
    """Sentences of a bidirectional encoder from the layer-1 pairs: per length hypothesis
    (`sentence_layouts`) and restart (``o.restarts``, round robin), position-wise assignment
    sweeps (`veil.attacks.span.search.sweep`, every passing pair used), then `refine`; the lowest
    mean layer-2 distance wins."""
    cands = cands[: last_position(cands)]
    pins = coverage_pins(cands, specials)
    rng = np.random.default_rng(seed)
    best: tuple[float, list[list[int]]] | None = None
    scored, lays = 0, sentence_layouts(cands, specials, B, pins, o)
    for lay in (lay for _ in range(max(1, o.restarts)) for lay in lays):
        score, seqs, n = _assign_layout(model, span2, cands, specials, lay, pins, rng, o)
        scored += n
        if best is None or score < best[0]:
            best = (score, seqs)
    if best is None:
        return [], {"sentences_scored": scored, "layouts": 0}
    return best[1], {"sentences_scored": scored, "layouts": len(lays), "mean_layer2_distance": best[0]}


def _assign_layout(
    model: VeilModel,
    span2: Span,
    cands: list[Tensor],
    specials: Specials,
    lay: Layout,
    pins: dict[int, int],
    rng: np.random.Generator,
    o: Assignment,
) -> tuple[float, list[list[int]], int]:
    """One restart on one length hypothesis: a random start, up to ``o.sweeps`` assignment sweeps
    (until one changes nothing), ``o.refine`` rounds of `refine`; returns the sentences' mean
    layer-2 distance, the sentences and how many sentences were scored."""
    sep, pad = specials.sep, specials.pad if specials.pad is not None else 0
    sets = [c.tolist() for c in cands]
    content = [[v for v in x if v != sep] for x in sets]
    mask = (torch.arange(max(lay.lengths))[None] < torch.tensor(lay.lengths)[:, None]).long()
    ids = initial_ids(lay, content, sets, sep, pad, rng)
    scored = 0
    for _ in range(o.sweeps):
        changed, n = sweep(model, span2, ids, mask, lay, content, rng, set(pins), set())
        scored += n
        if not changed:
            break
    seqs = [ids[b, :n].tolist() for b, n in enumerate(lay.lengths)]
    seqs, n = refine(model, span2, seqs, pad, o.refine)
    score = float(_costs(model, span2, seqs, pad).sum()) / sum(lay.lengths)
    return score, seqs, scored + n


def decoder_assign(
    model: VeilModel, span2: Span, cands: list[Tensor], specials: Specials, B: int
) -> tuple[list[list[int]], dict[str, object]]:
    """Sentences of a causal decoder from the layer-1 pairs, left to right (DAGER alg. 1 with a
    ranking instead of a threshold): layer 2's input at t depends only on tokens <= t, so at each
    position the passing tokens are assigned to the live prefixes by the layer-2 distance of the
    extended prefix's last position, every passing token used at least once. A sentence's last
    token is never scored in a causal LM (no gradient), so the number of live sentences at t is
    taken as the most tokens passing at any position >= t (ties of a shared token aside); the
    prefixes left out end there and get the tokenizer's [SEP]."""
    counts = [len(c) for c in cands]
    live_at = [max(counts[t:]) for t in range(len(counts))]
    prefixes: list[list[int]] = [[] for _ in range(max(1, min(B, max(counts, default=0))))]
    done: list[list[int]] = []
    scored = 0
    for t, c in enumerate(cands):
        k = min(live_at[t], len(prefixes))
        if k == 0 or not len(c):
            break
        toks = c.tolist()
        ext = torch.tensor([p + [v] for p in prefixes for v in toks])
        cost = (
            sentence_costs(model, span2, ext, torch.ones_like(ext))[:, -1]
            .view(len(prefixes), len(toks))
            .double()
            .numpy()
        )
        scored += len(ext)
        best: tuple[float, tuple[int, ...], np.ndarray] | None = None
        for keep in itertools.combinations(range(len(prefixes)), k):
            pick = assign(cost[list(keep)], np.ones(len(toks), dtype=bool))
            total = float(cost[list(keep), pick].sum())
            if best is None or total < best[0]:
                best = (total, keep, pick)
        assert best is not None
        _, keep, pick = best
        done += [prefixes[i] for i in range(len(prefixes)) if i not in keep]
        prefixes = [prefixes[i] + [toks[j]] for i, j in zip(keep, pick.tolist())]
    seqs = [x + ([specials.sep] if specials.sep is not None else []) for x in done + prefixes if x]
    return seqs, {"prefixes_scored": scored}
