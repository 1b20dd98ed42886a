"""`text_report`: every text score of `veil.metrics.text` and `veil.metrics.text_leak` for one
batch of reconstructions, after pairing them with the references (Hungarian matching).

It sits above both modules (they never import it), so the word-level scores and the shuffle-aware
ones stay one import apart, without a circle.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Literal

import numpy as np

from veil.metrics.matching import MetricInputError, hungarian_match, order_from_match
from veil.metrics.text import (
    Batch,
    Token,
    _check_texts,
    exact_recovery,
    google_bleu,
    pairwise_rouge_l,
    pairwise_token_accuracy,
    rouge,
    sacrebleu,
    token_accuracy,
    token_recovery,
)
from veil.metrics.text_leak import _slot_mask, bag_scores, moved_tokens, unshuffled_recovery


def text_report(
    refs: Batch,
    hyps: Batch,
    match: bool = True,
    ignore: Collection[Token] | None = None,
    match_by: Literal["rougeL", "token_accuracy"] = "rougeL",
    moved: Sequence[Sequence[bool]] | None = None,
    shuffled: Sequence[Sequence[bool]] | None = None,
) -> dict[str, float | list[int]]:
    """All text scores (`TEXT_KEYS`) after pairing reconstructions with references.

    With ``match=True`` pairs are chosen by Hungarian matching with cost ``-ROUGE-L`` (or
    ``-token_accuracy`` with ``match_by="token_accuracy"``), ties broken by token accuracy;
    ``hyps`` may then hold a different number of sequences than ``refs``. A reference left without
    a reconstruction (fewer hyps than refs) is scored against an empty sequence, a miss: an attack
    that rebuilds 2 sentences of 8 exactly has exact_recovery 0.25, not 1.0. Surplus hyps (more than
    refs) compete for the references and the unpaired ones are not scored, except by the bag scores. With ``match=False`` item ``b`` is
    compared with item ``b``. ``ignore`` (e.g. ``{"[CLS]", "[SEP]", "[PAD]"}``) is dropped from the
    word-level scores and not counted by token_recovery; token_accuracy and exact_recovery compare
    the raw sequences. ``moved`` and ``shuffled`` (one bool per reference token: the client's
    shuffle put another token there / selected the slot; the evaluator's record) give moved_tokens
    and unshuffled_recovery (see the module docstring); without them nothing counts as moved.

    Returns:
        the floats of `TEXT_KEYS`, plus ``"order"``: for each reference ``i``, the index of the
        hyp it was paired with (``-1`` if unmatched).
    """
    r, h = _check_texts(refs, hyps, same_len=not match)
    found = len(h)
    h = h + [[] for _ in range(len(r) - found)]  # every missed reference scores as an empty reconstruction
    shuffled = moved if shuffled is None else shuffled
    _slot_mask(moved, r, "moved"), _slot_mask(shuffled, r, "shuffled")  # reject a malformed record before matching
    if match:
        acc = pairwise_token_accuracy(r, h)
        if match_by == "rougeL":
            cost = -(pairwise_rouge_l(r, h, ignore) + 1e-6 * acc)
        elif match_by == "token_accuracy":
            cost = -acc
        else:
            raise MetricInputError(f"text_report: match_by must be 'rougeL' or 'token_accuracy', got {match_by!r}")
        rows, cols = hungarian_match(cost)
    else:
        rows = cols = np.arange(len(r), dtype=np.int64)
    rr = [r[i] for i in rows]
    hh = [h[j] for j in cols]
    report: dict[str, float | list[int]] = dict(rouge(rr, hh, ignore))
    report["sacrebleu"] = sacrebleu(rr, hh, ignore)
    report["google_bleu"] = google_bleu(rr, hh, ignore)
    report["token_accuracy"] = token_accuracy(rr, hh)
    report["token_recovery"] = token_recovery(rr, hh, ignore)
    report["exact_recovery"] = exact_recovery(rr, hh)
    report.update(
        bag_scores(r, h, ignore)
    )  # every reference and hyp (padding adds no word): the bag ignores the pairing
    report["unshuffled_recovery"] = unshuffled_recovery(
        rr, hh, [shuffled[i] for i in rows] if shuffled is not None else None, ignore
    )
    report["moved_tokens"] = float(moved_tokens(r, moved, ignore))  # every reference, matched or not
    paired = cols < found  # a reference paired with a padding row was not reconstructed
    report["order"] = order_from_match(rows[paired], cols[paired], len(r))
    return report
