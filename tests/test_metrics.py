"""Leakage metrics against hand-computed values, plus bad inputs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from veil.errors import VeilError
from veil.metrics import (
    IMAGE_KEYS,
    METRIC_KEYS,
    PRESENCE_KEYS,
    TEXT_KEYS,
    MetricInputError,
    exact_recovery,
    fft2d,
    google_bleu,
    hungarian_match,
    image_report,
    mse,
    presence,
    psnr,
    rouge,
    sacrebleu,
    ssim,
    ssim_window,
    text_report,
    to_words,
    token_accuracy,
    token_recovery,
)


def _const(value: float, shape=(1, 1, 8, 8)) -> torch.Tensor:
    return torch.full(shape, value)


# ----------------------------------------------------------------------------- matching
def test_hungarian_undoes_a_known_permutation():
    perm = np.array([2, 0, 3, 1])
    cost = np.ones((4, 4))
    cost[perm, np.arange(4)] = 0.0  # reconstruction j is original perm[j]
    rows, cols = hungarian_match(cost)
    assert rows.tolist() == [0, 1, 2, 3]
    assert perm[cols].tolist() == [0, 1, 2, 3]
    rows_t, cols_t = hungarian_match(torch.tensor(cost))
    assert cols_t.tolist() == cols.tolist()


def test_hungarian_rectangular():
    cost = np.array([[5.0, 1.0, 9.0], [1.0, 5.0, 9.0]])  # 2 originals, 3 reconstructions
    rows, cols = hungarian_match(cost)
    assert rows.tolist() == [0, 1] and cols.tolist() == [1, 0]
    rows, cols = hungarian_match(cost.T)  # 3 originals, 2 reconstructions
    assert rows.tolist() == [0, 1] and cols.tolist() == [1, 0]


@pytest.mark.parametrize("bad", [np.zeros(3), np.zeros((0, 2)), np.array([[np.nan, 1.0]])])
def test_hungarian_bad_input(bad):
    with pytest.raises(ValueError, match="hungarian_match"):
        hungarian_match(bad)


def test_error_type_is_value_error_and_veil_error():
    assert issubclass(MetricInputError, ValueError) and issubclass(MetricInputError, VeilError)


# ----------------------------------------------------------------------------- images
def test_mse_and_psnr_of_constant_error():
    x, y = _const(0.0), _const(0.1)
    assert mse(x, y) == pytest.approx(0.01, rel=1e-5)
    assert psnr(x, y) == pytest.approx(20.0, rel=1e-5)  # 10 log10(1 / 0.01)


def test_psnr_is_per_image_then_mean():
    x = torch.zeros(2, 1, 4, 4)
    y = torch.stack([torch.full((1, 4, 4), 0.1), torch.full((1, 4, 4), 0.01)])
    assert psnr(x, y) == pytest.approx((20.0 + 40.0) / 2, rel=1e-5)
    assert mse(x, y) == pytest.approx((0.01 + 0.0001) / 2, rel=1e-5)
    assert psnr(x, x) == math.inf


def test_psnr_and_ssim_match_torchmetrics():
    from torchmetrics.functional.image import peak_signal_noise_ratio, structural_similarity_index_measure

    g = torch.Generator().manual_seed(0)
    x = torch.rand(3, 3, 32, 32, generator=g)
    y = (x + 0.1 * torch.randn(x.shape, generator=g)).clamp(0, 1)
    assert psnr(x, y) == pytest.approx(float(peak_signal_noise_ratio(y, x, data_range=1.0, dim=(1, 2, 3))), rel=1e-5)
    assert ssim(x, y) == pytest.approx(float(structural_similarity_index_measure(y, x, data_range=1.0)), rel=1e-5)


def test_ssim_of_constant_images_by_hand():
    # constant images: SSIM = (2ab + C1) / (a^2 + b^2 + C1), C1 = (0.01 * 1)^2
    a, b, c1 = 0.5, 0.25, 1e-4
    assert ssim(_const(a), _const(b)) == pytest.approx((2 * a * b + c1) / (a * a + b * b + c1), rel=1e-4)
    x = torch.rand(2, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    assert ssim(x, x) == pytest.approx(1.0, abs=1e-6)


def test_ssim_window_for_small_images():
    assert ssim_window(32, 32) == (11, 1.5)
    assert ssim_window(8, 8) == (7, pytest.approx(1.5 * 7 / 11))
    assert ssim_window(4, 9)[0] == 3
    with pytest.raises(ValueError, match="at least 3x3"):
        ssim(_const(0.1, (1, 1, 2, 2)), _const(0.2, (1, 1, 2, 2)))


def test_fft2d_identical_and_hand_2x2():
    x = torch.rand(2, 3, 8, 8, generator=torch.Generator().manual_seed(2))
    assert fft2d(x, x) == pytest.approx(1.0)
    assert fft2d(x, 0.5 * x) == pytest.approx(1.0)  # cosine similarity ignores scale
    # [[1,0],[0,0]] has |FFT| = [1,1,1,1]; [[1,1],[0,0]] has |FFT| = [2,0,2,0]
    # cosine = (2 + 2) / (2 * sqrt(8)) = 1 / sqrt(2)
    a = torch.tensor([[1.0, 0.0], [0.0, 0.0]]).reshape(1, 1, 2, 2)
    b = torch.tensor([[1.0, 1.0], [0.0, 0.0]]).reshape(1, 1, 2, 2)
    assert fft2d(a, b) == pytest.approx(1 / math.sqrt(2))


def test_image_report_undoes_permutation():
    x = torch.rand(4, 3, 8, 8, generator=torch.Generator().manual_seed(3))
    perm = [2, 0, 3, 1]
    report = image_report(x, x[perm])
    assert set(IMAGE_KEYS) <= set(report)
    assert report["mse"] == 0.0 and report["psnr"] == math.inf
    assert report["ssim"] == pytest.approx(1.0, abs=1e-6) and report["fft2d"] == pytest.approx(1.0)
    assert report["order"] == np.argsort(perm).tolist()
    unmatched = image_report(x, x[perm], match=False)
    assert unmatched["order"] == [0, 1, 2, 3] and unmatched["mse"] > 0


def test_image_report_rectangular():
    x = torch.rand(4, 1, 8, 8, generator=torch.Generator().manual_seed(4))
    report = image_report(x, x[[3, 1]])
    assert report["order"] == [-1, 1, -1, 0]
    assert report["mse"] == 0.0


def test_image_bad_inputs():
    x = torch.rand(2, 3, 8, 8)
    with pytest.raises(ValueError, match="same shape"):
        mse(x, torch.rand(2, 3, 8, 7))
    with pytest.raises(ValueError, match="same shape"):
        image_report(x, torch.rand(3, 3, 8, 8), match=False)
    with pytest.raises(ValueError, match="same \\(C, H, W\\)"):
        image_report(x, torch.rand(3, 1, 8, 8))
    with pytest.raises(ValueError, match=r"\(B, C, H, W\)"):
        psnr(torch.rand(3, 8, 8), torch.rand(3, 8, 8))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        ssim(x, x * 255)
    with pytest.raises(ValueError, match="NaN"):
        fft2d(x, torch.full_like(x, float("nan")))
    with pytest.raises(ValueError, match="float"):
        mse(x, (x * 255).to(torch.uint8))


# ----------------------------------------------------------------------------- text
REF = ["the", "cat", "sat", "on", "the", "mat"]


def test_rouge_by_hand():
    scores = rouge([REF], [["the", "cat", "on", "mat"]])
    # ROUGE-1: 4 clipped unigram matches, P = 4/4, R = 4/6 -> F = 0.8
    assert scores["rouge1"] == pytest.approx(0.8)
    # ROUGE-2: 1 shared bigram ("the cat"), P = 1/3, R = 1/5 -> F = 0.25
    assert scores["rouge2"] == pytest.approx(0.25)
    # ROUGE-L: LCS "the cat on mat" = 4 -> same as ROUGE-1
    assert scores["rougeL"] == pytest.approx(0.8)


def test_wordpiece_pieces_are_joined():
    assert to_words(["[CLS]", "the", "play", "##ing", "cat", "[SEP]"], {"[CLS]", "[SEP]"}) == ["the", "playing", "cat"]
    assert to_words([101, 7, 102], {101, 102}) == ["7"]
    assert rouge([["the", "play", "##ing"]], [["the", "playing"]])["rouge1"] == pytest.approx(1.0)


def test_google_bleu_by_hand():
    hyp = ["the", "cat", "on", "the", "mat"]
    # n-grams (n=1..4): ref 6+5+4+3 = 18, hyp 5+4+3+2 = 14; matches 5 + 3 + 1 + 0 = 9
    assert google_bleu([REF], [hyp]) == pytest.approx(9 / 18)
    # corpus level: add an exact pair "a dog" (3 n-grams, all matched) -> (9 + 3) / (18 + 3)
    assert google_bleu([REF, ["a", "dog"]], [hyp, ["a", "dog"]]) == pytest.approx(12 / 21)
    assert google_bleu([["x"]], [["y"]]) == 0.0


def test_google_bleu_matches_nltk():
    gleu = pytest.importorskip("nltk.translate.gleu_score")
    refs = [REF, ["a", "dog", "runs", "in", "the", "park"], ["one", "two", "three"]]
    hyps = [["the", "cat", "on", "the", "mat"], ["a", "dog", "runs", "the", "park"], ["three", "two", "one", "four"]]
    expected = gleu.corpus_gleu([[r] for r in refs], hyps, min_len=1, max_len=4)
    assert google_bleu(refs, hyps) == pytest.approx(expected)


def test_sacrebleu_by_hand():
    assert sacrebleu([REF], [REF]) == pytest.approx(100.0)
    # all n-gram precisions 1; brevity penalty exp(1 - 7/6)
    longer = REF + ["today"]
    assert sacrebleu([longer], [REF]) == pytest.approx(100 * math.exp(1 - 7 / 6), rel=1e-4)
    assert sacrebleu([REF], [["x", "y", "z", "w"]]) == 0.0


def test_token_accuracy_recovery_exact_by_hand():
    refs = [[1, 2, 3, 4], [5, 6]]
    hyps = [[1, 2, 0, 4], [6, 5, 7]]
    assert token_accuracy(refs, hyps) == pytest.approx((3 / 4 + 0 / 2) / 2)
    assert token_recovery(refs, hyps) == pytest.approx(3 / 6)
    assert token_recovery(refs, hyps, ignore={4}) == pytest.approx(2 / 5)
    assert token_accuracy([[1, 2, 3]], [[1]]) == pytest.approx(1 / 3)
    assert exact_recovery([[1, 2], [3]], [[1, 2], [3, 4]]) == pytest.approx(0.5)
    # token strings, with special tokens ignored
    r = [["[CLS]", "a", "dog", "[SEP]", "[PAD]"]]
    h = [["[CLS]", "a", "cat", "[SEP]", "[PAD]"]]
    assert token_recovery(r, h, ignore={"[CLS]", "[SEP]", "[PAD]"}) == pytest.approx(1 / 2)
    assert token_accuracy(r, h) == pytest.approx(4 / 5)
    assert token_accuracy(torch.tensor([[1, 2]]), np.array([[1, 3]])) == pytest.approx(0.5)


def test_presence_by_hand():
    scores = presence({1, 2, 3, 4}, {2, 3, 5})
    assert set(scores) == set(PRESENCE_KEYS)
    assert scores["presence_precision"] == pytest.approx(2 / 3)
    assert scores["presence_recall"] == pytest.approx(1 / 2)
    assert scores["presence_f1"] == pytest.approx(4 / 7)
    assert presence({1}, set()) == {"presence_precision": 0.0, "presence_recall": 0.0, "presence_f1": 0.0}


def test_text_report_undoes_permutation():
    refs = [REF, ["a", "dog", "runs", "in", "the", "park"], ["one", "two", "three", "four", "five"]]
    perm = [2, 0, 1]
    report = text_report(refs, [refs[i] for i in perm])
    assert set(TEXT_KEYS) <= set(report)
    assert report["order"] == np.argsort(perm).tolist()
    for key in ("rouge1", "rouge2", "rougeL", "google_bleu", "token_accuracy", "token_recovery", "exact_recovery"):
        assert report[key] == pytest.approx(1.0), key
    assert report["sacrebleu"] == pytest.approx(100.0)
    unmatched = text_report(refs, [refs[i] for i in perm], match=False)
    assert unmatched["exact_recovery"] == 0.0 and unmatched["order"] == [0, 1, 2]


def test_text_report_rectangular_and_ids():
    report = text_report([[1, 2, 3], [4, 5]], [[4, 5], [1, 2, 9], [7]])
    assert report["order"] == [1, 0]
    assert report["token_accuracy"] == pytest.approx((2 / 3 + 1) / 2)
    assert report["exact_recovery"] == pytest.approx(0.5)
    by_acc = text_report([[1, 2, 3], [4, 5]], [[4, 5], [1, 2, 9]], match_by="token_accuracy")
    assert by_acc["order"] == [1, 0]


def test_text_bad_inputs():
    with pytest.raises(ValueError, match="same number of sequences"):
        token_accuracy([[1, 2]], [[1, 2], [3]])
    with pytest.raises(ValueError, match="is a string"):
        rouge(["the cat"], ["the cat"])
    with pytest.raises(ValueError, match="token strings or integer token ids"):
        exact_recovery([["a", 1]], [["a", 1]])
    with pytest.raises(ValueError, match="hyps hold token ids"):
        token_recovery([["a"]], [[1]])
    with pytest.raises(ValueError, match="empty batch"):
        google_bleu([], [])
    with pytest.raises(ValueError, match="match_by"):
        text_report([[1]], [[1]], match_by="bleu")  # type: ignore[arg-type]


def test_metric_keys():
    assert METRIC_KEYS == (
        "mse",
        "psnr",
        "ssim",
        "fft2d",
        "rouge1",
        "rouge2",
        "rougeL",
        "sacrebleu",
        "google_bleu",
        "token_accuracy",
        "token_recovery",
        "presence_precision",
        "presence_recall",
        "presence_f1",
        "exact_recovery",
        "bag_recall",
        "bag_precision",
        "unshuffled_recovery",
        "moved_tokens",
        "seconds",
    )
    assert set(IMAGE_KEYS) | set(TEXT_KEYS) | set(PRESENCE_KEYS) | {"seconds"} == set(METRIC_KEYS)


def test_text_report_counts_a_missed_reference_as_a_miss():
    """Two of four references rebuilt exactly: exact_recovery is 2/4, not 2/2 over the matched pairs."""
    refs = [[1, 2, 3], [4, 5], [6, 7, 8], [9]]
    report = text_report(refs, [[6, 7, 8], [4, 5]])
    assert report["exact_recovery"] == pytest.approx(0.5)
    assert report["token_accuracy"] == pytest.approx(0.5)
    assert report["token_recovery"] == pytest.approx(5 / 9)
    assert report["order"] == [-1, 1, 0, -1]
    assert report["bag_recall"] == pytest.approx(5 / 9) and report["bag_precision"] == pytest.approx(1.0)
