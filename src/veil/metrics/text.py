"""Text reconstruction quality: ROUGE, BLEU, Google-BLEU, token accuracy/recovery, presence.

Inputs are batches of token sequences: ``refs`` (the true sentences) and ``hyps`` (the
reconstructions), each a list of sequences of token strings (e.g. WordPiece tokens
``["the", "play", "##ing", "[SEP]"]``) or of token ids (ints; a 2-D tensor/array of ids also
works). Item ``b`` of ``hyps`` is compared with item ``b`` of ``refs``; `text_report`
(`veil.metrics.text_eval`) first pairs them by Hungarian matching.

Word-level scores (ROUGE, sacreBLEU, Google-BLEU) first turn each token sequence into words:
tokens in ``ignore`` are dropped, then WordPiece continuation pieces (``"##ing"``) are glued to
the previous token (``"play" "##ing"`` -> ``"playing"``), so that a word split into pieces counts
as one word, as it would in the untokenized sentence. Token ids are used as words ``str(id)``
(no gluing: ids carry no piece marker). Words are then scored as given (whitespace tokenization,
no lowercasing or stemming).

Definitions:

* ROUGE-1/2/L (Lin 2004, "ROUGE: A Package for Automatic Evaluation of Summaries"): F-measure
  from the ``rouge_score`` package per sentence pair, mean over the batch; in [0, 1].
* sacreBLEU (Papineni et al. 2002; Post 2018): corpus BLEU from ``sacrebleu.corpus_bleu`` on the
  space-joined words (default ``13a`` tokenizer, exp smoothing), in [0, 100].
* Google-BLEU / GLEU (Wu et al. 2016, "Google's Neural Machine Translation System", sec. 8; the
  HF ``evaluate`` ``google_bleu`` metric, i.e. ``nltk`` ``corpus_gleu`` with n = 1..4): for each
  pair count all 1- to 4-grams of hyp and ref, ``tp`` = clipped matching n-grams; corpus GLEU =
  ``sum(tp) / sum(max(#hyp n-grams, #ref n-grams))``, i.e. the minimum of n-gram precision and
  recall, pooled over the corpus. In [0, 1].
* token_accuracy: per pair, the share of reference positions ``i`` with ``hyp[i] == ref[i]``
  (over the reference length; hyp positions past the reference end are ignored), mean over the
  batch. An empty reference scores 1 if the hyp is empty too, else 0.
* token_recovery: position-aware recovery pooled over the batch: of all reference tokens not in
  ``ignore`` (e.g. [CLS], [SEP], [PAD]), the share that the paired reconstruction puts at the same
  position of its sentence. 0 if there is no such token.
* presence (bag-of-tokens, as in gradient-leakage token recovery): precision/recall/F1 of the
  predicted token set against the true token set.
* exact_recovery: share of pairs whose hyp equals its ref token for token.
* bag_recall / bag_precision, unshuffled_recovery, moved_tokens: what a shuffling defense leaves
  (`veil.metrics.text_leak`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterable, Sequence
from itertools import chain

import numpy as np
import sacrebleu as _sacrebleu
import torch
from rouge_score import rouge_scorer, tokenizers

from veil.metrics.matching import MetricInputError

Token = str | int
Batch = Sequence[Sequence[Token]] | torch.Tensor | np.ndarray

TEXT_KEYS: tuple[str, ...] = (
    "rouge1",
    "rouge2",
    "rougeL",
    "sacrebleu",
    "google_bleu",
    "token_accuracy",
    "token_recovery",
    "exact_recovery",
    "bag_recall",
    "bag_precision",
    "unshuffled_recovery",
    "moved_tokens",
)
PRESENCE_KEYS: tuple[str, ...] = ("presence_precision", "presence_recall", "presence_f1")


# ----------------------------------------------------------------------------- input checks
def _as_batch(batch: Batch, name: str) -> list[list[Token]]:
    """Normalise a batch to ``list[list[str | int]]`` and reject the common mistakes."""
    if isinstance(batch, (torch.Tensor, np.ndarray)):
        if batch.ndim != 2:
            raise MetricInputError(
                f"{name}: a tensor/array of token ids must be 2-D (batch, length), got shape {tuple(batch.shape)}"
            )
        batch = batch.tolist()
    if isinstance(batch, (str, bytes)) or not isinstance(batch, Sequence):
        raise MetricInputError(f"{name} must be a list of token sequences, got {type(batch).__name__}")
    if len(batch) == 0:
        raise MetricInputError(f"{name} is an empty batch")
    out: list[list[Token]] = []
    for b, seq in enumerate(batch):
        if isinstance(seq, (str, bytes)):
            raise MetricInputError(
                f"{name}[{b}] is a string, expected a sequence of tokens; pass a batch such as "
                f"[['the', 'cat'], ...] (tokenize sentences first, e.g. s.split())"
            )
        if isinstance(seq, (torch.Tensor, np.ndarray)):
            seq = seq.tolist()
        if not isinstance(seq, Sequence):
            raise MetricInputError(f"{name}[{b}] must be a sequence of tokens, got {type(seq).__name__}")
        out.append([int(t) if isinstance(t, (np.integer, int)) and not isinstance(t, bool) else t for t in seq])
    return out


def _kind(batch: list[list[Token]], name: str) -> str | None:
    kinds = {type(t) for seq in batch for t in seq}
    if not kinds:
        return None
    if kinds == {str}:
        return "str"
    if kinds == {int}:
        return "int"
    raise MetricInputError(
        f"{name} must hold either token strings or integer token ids, got types {sorted(k.__name__ for k in kinds)}"
    )


def _check_texts(refs: Batch, hyps: Batch, *, same_len: bool = True) -> tuple[list[list[Token]], list[list[Token]]]:
    r = _as_batch(refs, "refs")
    h = _as_batch(hyps, "hyps")
    if same_len and len(r) != len(h):
        raise MetricInputError(
            f"refs and hyps must have the same number of sequences, got {len(r)} and {len(h)} "
            f"(use text_report(match=True) to pair batches of different sizes)"
        )
    kr, kh = _kind(r, "refs"), _kind(h, "hyps")
    if kr is not None and kh is not None and kr != kh:
        raise MetricInputError(
            f"refs hold token {'strings' if kr == 'str' else 'ids'} but hyps hold token "
            f"{'strings' if kh == 'str' else 'ids'}; decode or encode one side first"
        )
    return r, h


# ----------------------------------------------------------------------------- encoding
def _ignore_array(ignore: Collection[Token] | None, sample: np.ndarray) -> np.ndarray:
    """``ignore`` as an array of the same kind as ``sample`` (str tokens or int ids)."""
    if not ignore:
        return sample[:0]
    want = str if sample.dtype.kind == "U" else int
    return np.array([t for t in ignore if isinstance(t, want) and not isinstance(t, bool)], dtype=sample.dtype)


def _encode(
    batches: Sequence[list[list[Token]]], ignore: Collection[Token] | None = None
) -> tuple[list[np.ndarray], np.ndarray]:
    """Map the tokens of several batches to shared integer codes.

    Returns one ``(B, L)`` int64 array per batch (``-1`` past each sequence's end; ``L`` is the
    longest sequence over all batches) and a bool array over codes: True where the token is in
    ``ignore``.
    """
    lengths = [np.array([len(s) for s in b], dtype=np.int64) for b in batches]
    flat = np.array(list(chain.from_iterable(chain.from_iterable(batches))))
    if flat.size == 0:
        flat = np.zeros(0, dtype=np.int64)
    vocab, inverse = np.unique(flat, return_inverse=True)
    ignored = np.isin(vocab, _ignore_array(ignore, vocab))
    width = max((int(n.max()) for n in lengths if n.size), default=0)
    out: list[np.ndarray] = []
    offset = 0
    for n in lengths:
        codes = np.full((n.size, width), -1, dtype=np.int64)
        mask = np.arange(width)[None, :] < n[:, None]
        total = int(n.sum())
        codes[mask] = inverse.reshape(-1)[offset : offset + total]
        offset += total
        out.append(codes)
    return out, ignored


# ----------------------------------------------------------------------------- words
def to_words(tokens: Sequence[Token], ignore: Collection[Token] | None = None) -> list[str]:
    """Words of one token sequence: drop ``ignore`` tokens, glue WordPiece ``##`` pieces; ids -> ``str(id)``."""
    arr = np.array(list(tokens))
    if arr.size == 0:
        return []
    if ignore:
        arr = arr[~np.isin(arr, _ignore_array(ignore, arr))]
    text = " ".join(arr.astype(str).tolist())
    if arr.dtype.kind == "U":
        text = text.replace(" ##", "")
        if text.startswith("##"):
            text = text[2:]
    return text.split()


class _WhitespaceTokenizer(tokenizers.Tokenizer):
    """rouge_score tokenizer that keeps the words given (whitespace split, no normalisation)."""

    def tokenize(self, text: str) -> list[str]:
        return text.split()


_SCORER = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], tokenizer=_WhitespaceTokenizer())
_SCORER_L = rouge_scorer.RougeScorer(["rougeL"], tokenizer=_WhitespaceTokenizer())


def _joined(batch: list[list[Token]], ignore: Collection[Token] | None) -> list[str]:
    return [" ".join(to_words(seq, ignore)) for seq in batch]


# ----------------------------------------------------------------------------- scores
def rouge(refs: Batch, hyps: Batch, ignore: Collection[Token] | None = None) -> dict[str, float]:
    """ROUGE-1/2/L F-measures (``rouge_score``), mean over pairs: ``{"rouge1", "rouge2", "rougeL"}``."""
    r, h = _check_texts(refs, hyps)
    scores = [_SCORER.score(ref, hyp) for ref, hyp in zip(_joined(r, ignore), _joined(h, ignore))]
    return {k: float(np.mean([s[k].fmeasure for s in scores])) for k in ("rouge1", "rouge2", "rougeL")}


def sacrebleu(refs: Batch, hyps: Batch, ignore: Collection[Token] | None = None) -> float:
    """Corpus BLEU from ``sacrebleu.corpus_bleu`` (default settings) on the words, 0-100."""
    r, h = _check_texts(refs, hyps)
    return float(_sacrebleu.corpus_bleu(_joined(h, ignore), [_joined(r, ignore)]).score)


def _ngram_counts(words: Sequence[str], max_n: int) -> Counter:
    counts: Counter = Counter()
    for n in range(1, max_n + 1):
        counts.update(zip(*(words[i:] for i in range(n))))
    return counts


def google_bleu(refs: Batch, hyps: Batch, ignore: Collection[Token] | None = None, max_n: int = 4) -> float:
    """Corpus Google-BLEU (GLEU, Wu et al. 2016): ``sum(tp) / sum(max(#hyp n-grams, #ref n-grams))``, n=1..max_n.

    ``tp`` counts n-grams present in both (clipped to the smaller count). Equals the HF
    ``evaluate`` ``google_bleu`` metric (single reference) on the same words. In [0, 1].
    """
    r, h = _check_texts(refs, hyps)
    if max_n < 1:
        raise MetricInputError(f"google_bleu: max_n must be >= 1, got {max_n}")
    matched = total = 0
    for ref, hyp in zip(r, h):
        rc = _ngram_counts(to_words(ref, ignore), max_n)
        hc = _ngram_counts(to_words(hyp, ignore), max_n)
        n_all = max(sum(rc.values()), sum(hc.values()))
        if n_all > 0:
            matched += sum((rc & hc).values())
            total += n_all
    return matched / total if total else 0.0


def _position_hits(
    r: list[list[Token]], h: list[list[Token]], ignore: Collection[Token] | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(valid, hit, ignored)`` arrays of shape (B, L): a reference token is there; the hyp has the
    same token at that position; the reference token is in ``ignore``."""
    (ref, hyp), ignored_code = _encode([r, h], ignore)
    valid = ref >= 0
    hit = (ref == hyp) & valid
    ignored = valid & ignored_code[np.where(valid, ref, 0)] if ignored_code.size else np.zeros_like(valid)
    return valid, hit, ignored


def token_accuracy(refs: Batch, hyps: Batch) -> float:
    """Mean over pairs of the share of reference positions where ``hyp[i] == ref[i]``."""
    r, h = _check_texts(refs, hyps)
    valid, hit, _ = _position_hits(r, h)
    n_ref = valid.sum(1)
    empty_ok = np.array([len(x) == 0 for x in h])
    per = np.where(n_ref > 0, hit.sum(1) / np.maximum(n_ref, 1), empty_ok.astype(float))
    return float(per.mean())


def token_recovery(refs: Batch, hyps: Batch, ignore: Collection[Token] | None = None) -> float:
    """Share of the reference tokens (not in ``ignore``) that the hyp puts at their own position.

    Pooled over the batch (each true token weighs the same). 0 if no token is counted.
    """
    r, h = _check_texts(refs, hyps)
    valid, hit, ignored = _position_hits(r, h, ignore)
    valid = valid & ~ignored
    n = int(valid.sum())
    return float((hit & valid).sum() / n) if n else 0.0


def presence(true_token_ids: Iterable[Token], predicted: Iterable[Token]) -> dict[str, float]:
    """Bag-of-tokens precision/recall/F1 of ``predicted`` against ``true_token_ids`` (both as sets).

    Precision is 0 for an empty prediction, recall 0 for an empty truth, F1 0 when both are 0.
    """
    for name, s in (("true_token_ids", true_token_ids), ("predicted", predicted)):
        if isinstance(s, (str, bytes)):
            raise MetricInputError(f"presence: {name} must be a set of tokens, got a string")
    t, p = set(true_token_ids), set(predicted)
    tp = len(t & p)
    precision = tp / len(p) if p else 0.0
    recall = tp / len(t) if t else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall > 0 else 0.0
    return {"presence_precision": precision, "presence_recall": recall, "presence_f1": f1}


def exact_recovery(refs: Batch, hyps: Batch) -> float:
    """Share of pairs whose hyp equals its reference exactly (same tokens, same length)."""
    r, h = _check_texts(refs, hyps)
    return float(np.mean([a == b for a, b in zip(r, h)]))


# ----------------------------------------------------------------------------- matching
def pairwise_rouge_l(refs: Batch, hyps: Batch, ignore: Collection[Token] | None = None) -> np.ndarray:
    """``(n_refs, n_hyps)`` matrix of ROUGE-L F-measures."""
    r, h = _check_texts(refs, hyps, same_len=False)
    rj, hj = _joined(r, ignore), _joined(h, ignore)
    return np.array([[_SCORER_L.score(a, b)["rougeL"].fmeasure for b in hj] for a in rj], dtype=np.float64)


def pairwise_token_accuracy(refs: Batch, hyps: Batch) -> np.ndarray:
    """``(n_refs, n_hyps)`` matrix of per-pair token accuracy."""
    r, h = _check_texts(refs, hyps, same_len=False)
    (ref, hyp), _ = _encode([r, h])
    valid = ref >= 0
    hits = ((ref[:, None, :] == hyp[None, :, :]) & valid[:, None, :]).sum(-1)
    n_ref = valid.sum(1)[:, None]
    empty_hyp = (hyp[:, 0] < 0 if hyp.shape[1] else np.ones(len(h), dtype=bool)).astype(float)[None, :]
    return np.where(n_ref > 0, hits / np.maximum(n_ref, 1), empty_hyp)
