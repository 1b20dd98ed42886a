"""A token n-gram language model from public text, and a beam search that orders a bag of tokens
into the free slots of a sentence (the word-order prior of `veil.attacks.span.mjp`).

Model: interpolated Kneser-Ney (Kneser & Ney 1995; Chen & Goodman 1999, eq. 26) over token ids of
the attacker's public tokenizer, with one absolute discount ``d`` at every order:

    P(w | h) = max(c(h w) - d, 0) / c(h .) + d * N1+(h .) / c(h .) * P(w | h'),

h' = h without its first token, c(h .) = occurrences of h followed by anything, N1+(h .) = distinct
tokens seen after h; an unseen history falls back to P(w | h'). The lowest order is the
continuation unigram ``(N1+(. w) + 1) / (sum_v N1+(. v) + V)`` (add-one over the tokenizer's V
ids, so an unseen token keeps a small probability). Sentences are padded with ``order - 1`` [CLS]
in front and end with the tokenizer's [SEP].

`order_bag` fills the free slots of a template (fixed tokens at known positions, free slots to
be filled from a multiset) left to right with a beam over (sentence so far, tokens left): all
candidate extensions of the beam are scored at once on a dense table of log P over the
sentence's own few distinct tokens (`NGram.table`), and the `beam` best are kept.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

import numpy as np

from veil.errors import VeilError


class NGram:
    """Interpolated Kneser-Ney over token ids (see the module docstring)."""

    def __init__(
        self, sentences: Iterable[Sequence[int]], vocab_size: int, bos: int, order: int = 3, discount: float = 0.75
    ) -> None:
        if order < 2:
            raise VeilError(f"ngram order must be >= 2, got {order}")
        if not 0 < discount < 1:
            raise VeilError(f"ngram discount must be in (0, 1), got {discount}")
        self.order, self.d, self.vocab_size, self.bos = order, float(discount), int(vocab_size), int(bos)
        self.counts: list[Counter] = [Counter() for _ in range(order + 1)]  # counts[n][(tokens...)] for n >= 2
        sentences_seen = 0
        for s in sentences:
            toks = (self.bos,) * (order - 1) + tuple(int(t) for t in s)
            for n in range(2, order + 1):
                self.counts[n].update(zip(*(toks[i:] for i in range(n))))
            sentences_seen += 1
        if not sentences_seen:
            raise VeilError("ngram needs at least one sentence of public text")
        self.sentences = sentences_seen
        self.ctx: list[Counter] = [Counter() for _ in range(order + 1)]  # c(h .) for histories of length n-1
        self.types: list[Counter] = [Counter() for _ in range(order + 1)]  # N1+(h .)
        for n in range(2, order + 1):
            for gram, c in self.counts[n].items():
                self.ctx[n][gram[:-1]] += c
                self.types[n][gram[:-1]] += 1
        cont = Counter(g[-1] for g in self.counts[2])  # N1+(. w)
        self.cont, self.cont_total = cont, sum(cont.values())

    def _p(self, hist: tuple[int, ...], w: int) -> float:
        if not hist:
            return (self.cont.get(w, 0) + 1) / (self.cont_total + self.vocab_size)
        lower = self._p(hist[1:], w)
        n = len(hist) + 1
        c_h = self.ctx[n].get(hist, 0)
        if not c_h:
            return lower
        c = self.counts[n].get(hist + (w,), 0)
        return max(c - self.d, 0.0) / c_h + self.d * self.types[n][hist] / c_h * lower

    def logprob(self, hist: Sequence[int], w: int) -> float:
        """log P(w | the last order-1 tokens of hist)."""
        h = tuple(int(t) for t in hist)[-(self.order - 1) :]
        h = (self.bos,) * (self.order - 1 - len(h)) + h
        return float(np.log(self._p(h, int(w))))

    def table(self, tokens: Sequence[int]) -> np.ndarray:
        """Dense log P over the given distinct tokens: shape (m,) * order, entry [h..., w]."""
        toks = [int(t) for t in tokens]
        m, k = len(toks), self.order - 1
        out = np.empty((m,) * self.order, dtype=np.float64)
        for idx in np.ndindex(*(m,) * k):
            h = tuple(toks[i] for i in idx)
            out[idx] = [np.log(self._p(h, w)) for w in toks]
        return out


def order_bag(
    lm: NGram, template: Sequence[int | None], bag: Sequence[int], beam: int = 256
) -> tuple[list[int], float]:
    """Fill the None slots of `template` with the tokens of `bag` (a multiset, as many as there are
    None slots) in the order of highest n-gram log-probability found by a beam of width `beam`.
    Returns the sentence and its log-probability."""
    free = sum(t is None for t in template)
    if free != len(bag):
        raise VeilError(f"order_bag: {free} free slots but {len(bag)} tokens in the bag")
    if free == 0:
        s = [int(t) for t in template]  # type: ignore[arg-type]
        return s, _sentence_logprob(lm, s)
    local = sorted({int(t) for t in template if t is not None} | {int(t) for t in bag} | {lm.bos})
    code = {v: i for i, v in enumerate(local)}
    logp = lm.table(local)
    k = lm.order - 1
    hist = np.full((1, k), code[lm.bos], dtype=np.int64)  # the last k tokens of each beam entry
    seqs = np.zeros((1, 0), dtype=np.int64)
    left = np.bincount([code[int(t)] for t in bag], minlength=len(local))[None]  # (K, m) tokens still to place
    score = np.zeros(1)
    for slot in template:
        if slot is not None:
            w = np.full(len(score), code[int(slot)])
            score = score + logp[tuple(hist.T) + (w,)]
            nxt = w
        else:
            rows, w = np.nonzero(left > 0)  # every (beam entry, token left) extension
            cand = score[rows] + logp[tuple(hist[rows].T) + (w,)]
            keep = _top(cand, beam)
            rows, w, score = rows[keep], w[keep], cand[keep]
            hist, seqs = hist[rows], seqs[rows]
            left = left[rows].copy()
            left[np.arange(len(rows)), w] -= 1
            nxt = w
        hist = np.concatenate([hist[:, 1:], nxt[:, None]], axis=1)
        seqs = np.concatenate([seqs, nxt[:, None]], axis=1)
    best = int(np.argmax(score))
    return [local[i] for i in seqs[best].tolist()], float(score[best])


def _top(x: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest entries, best first (stable for ties: deterministic)."""
    order = np.argsort(-x, kind="stable")
    return order[:k]


def _sentence_logprob(lm: NGram, s: Sequence[int]) -> float:
    hist = [lm.bos] * (lm.order - 1)
    total = 0.0
    for w in s:
        total += lm.logprob(hist, w)
        hist = hist[1:] + [int(w)]
    return total
