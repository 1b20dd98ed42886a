"""Text scores of what a shuffling defense (MJP) leaves to an attacker: the client's words as a
bag, and the words it did not shuffle at their own positions. Inputs as in `veil.metrics.text`
(batches of token sequences, strings or ids); `text_report` reports them with the other scores.

* bag_recall / bag_precision: the words as a multiset, pooled over the batch (pairing does not
  matter): with R and H the multisets of all reference and all hyp words, ``|R & H| / |R|`` and
  ``|R & H| / |H|`` (``&`` keeps the smaller count of each word); 0 when the denominator is 0. What
  an attacker holds when it has the client's words but not their order.
* unshuffled_recovery: token_recovery restricted to the reference tokens a shuffling defense left
  out of its shuffle (``shuffled``: per reference, one bool per token, True at the slots MJP
  selected; from the evaluator's record of the client's step, never from the attacker). A selected
  token the permutation happened to leave in its slot still counts as shuffled (MJP hid its
  position behind E_unk). Without ``shuffled`` the ``moved`` slots stand in; with neither it
  equals token_recovery.
* moved_tokens: how many reference tokens (not in ``ignore``) the shuffle moved (``moved``: True
  where the client's shuffle put another token in that slot), summed over the batch (0 without a
  shuffle record: the report then says that none moved).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Sequence
from itertools import chain

import numpy as np
import torch

from veil.metrics.matching import MetricInputError
from veil.metrics.text import Batch, Token, _as_batch, _check_texts, _position_hits, to_words

__all__ = ["bag_scores", "unshuffled_recovery", "moved_tokens"]


def bag_scores(refs: Batch, hyps: Batch, ignore: Collection[Token] | None = None) -> dict[str, float]:
    """``{"bag_recall", "bag_precision"}`` of the pooled word multisets (see the module docstring)."""
    r, h = _check_texts(refs, hyps, same_len=False)
    rc = Counter(chain.from_iterable(to_words(seq, ignore) for seq in r))
    hc = Counter(chain.from_iterable(to_words(seq, ignore) for seq in h))
    common = sum((rc & hc).values())
    n_r, n_h = sum(rc.values()), sum(hc.values())
    return {"bag_recall": common / n_r if n_r else 0.0, "bag_precision": common / n_h if n_h else 0.0}


def _slot_mask(flags: Sequence[Sequence[bool]] | None, r: list[list[Token]], name: str) -> np.ndarray:
    """Per-token flags as a (B, L) bool array aligned with the references; all False when None."""
    out = np.zeros((len(r), max((len(x) for x in r), default=0)), dtype=bool)
    if flags is None:
        return out
    if len(flags) != len(r):
        raise MetricInputError(f"{name} must hold one entry per reference, got {len(flags)} for {len(r)} references")
    for b, (m, ref) in enumerate(zip(flags, r)):
        m = np.asarray(m.tolist() if isinstance(m, torch.Tensor) else m, dtype=bool).reshape(-1)
        if len(m) != len(ref):
            raise MetricInputError(f"{name}[{b}] has {len(m)} entries for a reference of {len(ref)} tokens")
        out[b, : len(m)] = m
    return out


def unshuffled_recovery(
    refs: Batch, hyps: Batch, shuffled: Sequence[Sequence[bool]] | None = None, ignore: Collection[Token] | None = None
) -> float:
    """Share of the reference tokens outside the shuffle (and not in ``ignore``) that the hyp puts at
    their own position; 0 if there is none. Item b is compared with item b."""
    r, h = _check_texts(refs, hyps)
    valid, hit, ignored = _position_hits(r, h, ignore)
    keep = valid & ~ignored
    mask = _slot_mask(shuffled, r, "shuffled")  # as wide as the longest reference (<= keep's width)
    keep[:, : mask.shape[1]] &= ~mask
    n = int(keep.sum())
    return float((hit & keep).sum() / n) if n else 0.0


def moved_tokens(refs: Batch, moved: Sequence[Sequence[bool]] | None, ignore: Collection[Token] | None = None) -> int:
    """How many reference tokens (not in ``ignore``) the shuffle moved."""
    r = _as_batch(refs, "refs")
    valid, _, ignored = _position_hits(r, r, ignore)
    counted = valid & ~ignored
    return int((counted & _slot_mask(moved, r, "moved")).sum())
