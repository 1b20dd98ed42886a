"""Leakage metrics: how close an attack's reconstruction is to the private inputs.

Images (`veil.metrics.image`): MSE, PSNR, SSIM (Wang et al. 2004), FFT2D (MJP: cosine similarity
of 2-D FFT magnitude spectra). Text (`veil.metrics.text`,
`veil.metrics.text_leak`):
ROUGE-1/2/L (Lin 2004), sacreBLEU (Papineni et al. 2002; Post 2018), Google-BLEU (Wu et al. 2016),
token accuracy, position-aware token recovery, bag-of-tokens presence P/R/F1, exact recovery, the
words as a pooled multiset (bag recall/precision), and the tokens a shuffling defense left
outside its shuffle at their positions (unshuffled recovery, with the count of moved tokens).
Batches are paired with Hungarian matching (`veil.metrics.matching`) before scoring.

`METRIC_KEYS` lists every stable key a metrics record may carry (``seconds`` is the attack's
wall time, filled in by the caller).
"""

from __future__ import annotations

from veil.metrics.image import (
    IMAGE_KEYS,
    fft2d,
    image_report,
    mse,
    pairwise_mse,
    psnr,
    ssim,
    ssim_window,
)
from veil.metrics.matching import MetricInputError, hungarian_match, order_from_match
from veil.metrics.text import (
    PRESENCE_KEYS,
    TEXT_KEYS,
    exact_recovery,
    google_bleu,
    pairwise_rouge_l,
    pairwise_token_accuracy,
    presence,
    rouge,
    sacrebleu,
    to_words,
    token_accuracy,
    token_recovery,
)
from veil.metrics.text_eval import text_report
from veil.metrics.text_leak import bag_scores, moved_tokens, unshuffled_recovery

#: every stable key of a metrics record, in its column order: the image scores, the text scores
#: with the presence scores before exact recovery, then the attack's wall time
_EXACT = TEXT_KEYS.index("exact_recovery")
METRIC_KEYS: tuple[str, ...] = (*IMAGE_KEYS, *TEXT_KEYS[:_EXACT], *PRESENCE_KEYS, *TEXT_KEYS[_EXACT:], "seconds")

#: veil.metrics's public names, the one list of them (the submodules keep none of their own)
__all__ = [
    "METRIC_KEYS",
    "IMAGE_KEYS",
    "TEXT_KEYS",
    "PRESENCE_KEYS",
    "MetricInputError",
    "hungarian_match",
    "order_from_match",
    "mse",
    "psnr",
    "ssim",
    "ssim_window",
    "fft2d",
    "pairwise_mse",
    "image_report",
    "to_words",
    "rouge",
    "sacrebleu",
    "google_bleu",
    "token_accuracy",
    "token_recovery",
    "presence",
    "exact_recovery",
    "bag_scores",
    "unshuffled_recovery",
    "moved_tokens",
    "pairwise_rouge_l",
    "pairwise_token_accuracy",
    "text_report",
]
