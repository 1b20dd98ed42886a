"""Membership-inference scores to numbers: the ROC curve, TPR at a fixed low FPR, AUC (Carlini
et al., IEEE S&P 2022, "Membership Inference Attacks From First Principles", Sec. III: an attack
is judged by its true-positive rate at a low false-positive rate, read off a log-scale ROC curve;
balanced accuracy and AUC hide the confident hits that matter).

A score is higher for "member". `roc` sweeps every threshold; `tpr_at` takes the largest TPR
among thresholds whose FPR does not exceed the target (with n non-members the finest FPR is 1/n:
at 0.1 % FPR and fewer than 1,000 non-members that is the TPR at zero false positives).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from veil.errors import VeilError

FPRS = (0.001, 0.01)


def roc(members: np.ndarray, nonmembers: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(fpr, tpr) at every threshold, from (0, 0) to (1, 1); ties move together."""
    a, b = np.asarray(members, dtype=float), np.asarray(nonmembers, dtype=float)
    if len(a) == 0 or len(b) == 0:
        raise VeilError(f"membership ROC needs members and non-members, got {len(a)} and {len(b)}")
    scores = np.concatenate([a, b])
    truth = np.concatenate([np.ones(len(a)), np.zeros(len(b))])
    order = np.argsort(-scores, kind="stable")
    s, t = scores[order], truth[order]
    last = np.r_[np.nonzero(np.diff(s))[0], len(s) - 1]  # the end of each run of tied scores
    tp, fp = np.cumsum(t)[last], np.cumsum(1 - t)[last]
    return np.r_[0.0, fp / len(b)], np.r_[0.0, tp / len(a)]


def tpr_at(fpr: np.ndarray, tpr: np.ndarray, target: float) -> float:
    """The largest TPR whose FPR is <= target."""
    return float(tpr[fpr <= target + 1e-12].max())


def auc(fpr: np.ndarray, tpr: np.ndarray) -> float:
    return float(np.trapezoid(tpr, fpr))


def curve_points(fpr: np.ndarray, tpr: np.ndarray, points: int = 60) -> list[list[float]]:
    """The ROC at log-spaced FPRs from 1e-4 to 1 (step interpolation: the TPR reached at each), for
    a log-scale figure; small enough to keep in a summary."""
    grid = np.logspace(-4, 0, points)
    return [[float(f), tpr_at(fpr, tpr, float(f))] for f in grid]


def summarize(members: np.ndarray, nonmembers: np.ndarray) -> dict[str, Any]:
    """TPR at 0.1 % and 1 % FPR, AUC, the counts, and the curve's points."""
    fpr, tpr = roc(members, nonmembers)
    out: dict[str, Any] = {f"tpr_at_{f:g}": tpr_at(fpr, tpr, f) for f in FPRS}
    out.update(auc=auc(fpr, tpr), members=len(members), nonmembers=len(nonmembers), curve=curve_points(fpr, tpr))
    return out
