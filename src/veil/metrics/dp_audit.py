"""The one-run epsilon lower bound (Steinke, Nasr, Jagielski, NeurIPS 2023, "Privacy Auditing with
One (1) Training Run", Theorem 3.1 and the bisection of their Appendix D).

m canaries are each included in the training set independently with probability 1/2 (S_i in
{-1, +1}); after one run the auditor guesses T_i in {-1, 0, +1} for each (0: abstain), r = the
number of non-abstentions, v = the number of correct guesses. If the training algorithm is
(epsilon, delta)-DP, then

    P[v correct or more] <= beta + 2 m delta alpha,                           (Thm. 3.1)
    beta  = P[Binomial(r, q) >= v],          q = e^eps / (1 + e^eps)
    alpha = max_{i = 1..v}  P[v > Binomial(r, q) >= v - i] / i

so an observed (r, v) whose p-value is below 1 - confidence refutes (epsilon, delta)-DP for that
epsilon: epsilon-hat is the largest epsilon refuted (p-value increases with epsilon; bisection).
The guesses come from scores: the k+ highest-scored canaries are guessed in, the k- lowest out.
Trying several (k+, k-) and keeping the best inflates the confidence, so `audit` tests each of
its G guess counts at level (1 - confidence) / G (Bonferroni): the reported epsilon-hat holds at
the stated confidence as a whole.

An epsilon-hat above the epsilon an accountant claims for the same run cannot come from a
correct mechanism (up to the 1 - confidence chance of a false alarm): it is a bug in the
mechanism (`flagged`), never a privacy finding.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from scipy import stats

from veil.errors import VeilError

#: fractions of the m canaries guessed in (k+); each is tried with k- = 0 and with k- = k+
GUESS_FRACTIONS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5)


def p_value(m: int, r: int, v: int, eps: float, delta: float) -> float:
    """P[>= v of r guesses correct] bounded under (eps, delta)-DP with m canaries (Thm. 3.1)."""
    if not 0 <= v <= r <= m:
        raise VeilError(f"one-run audit needs 0 <= v <= r <= m, got v={v}, r={r}, m={m}")
    if eps < 0 or not 0 <= delta <= 1:
        raise VeilError(f"one-run audit needs eps >= 0 and delta in [0, 1], got eps={eps}, delta={delta}")
    q = 1.0 / (1.0 + math.exp(-eps))
    beta = float(stats.binom.sf(v - 1, r, q))
    alpha = 0.0
    if v > 0:
        below = np.cumsum(stats.binom.pmf(np.arange(v - 1, -1, -1), r, q))  # P[v > Bin >= v - i], i = 1..v
        alpha = float(np.max(below / np.arange(1, v + 1)))
    return min(beta + alpha * delta * 2 * m, 1.0)


def epsilon_lower_bound(m: int, r: int, v: int, delta: float, confidence: float = 0.95, tol: float = 1e-6) -> float:
    """The largest epsilon that (r, v) refutes at `confidence` (0 when it refutes none)."""
    if not 0 < confidence < 1:
        raise VeilError(f"confidence must be in (0, 1), got {confidence}")
    level = 1.0 - confidence
    if p_value(m, r, v, 0.0, delta) >= level:
        return 0.0
    lo, hi = 0.0, 1.0
    while p_value(m, r, v, hi, delta) < level:
        lo, hi = hi, 2 * hi
        if hi > 1e3:  # every guess right with r -> inf only; a finite r refutes a finite epsilon
            return lo
    while hi - lo > tol:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if p_value(m, r, v, mid, delta) < level else (lo, mid)
    return lo


def guess_counts(m: int, fractions: tuple[float, ...] = GUESS_FRACTIONS) -> list[tuple[int, int]]:
    """The (k+, k-) pairs `audit` tries: k+ = a fraction of m (at least 1), k- = 0 or k+."""
    pairs: list[tuple[int, int]] = []
    for f in fractions:
        k = max(1, int(round(f * m)))
        for pair in ((k, 0), (k, k)):
            if sum(pair) <= m and pair not in pairs:
                pairs.append(pair)
    return pairs


def audit(
    scores: np.ndarray,
    included: np.ndarray,
    delta: float,
    confidence: float = 0.95,
    seed: int = 0,
    fractions: tuple[float, ...] = GUESS_FRACTIONS,
) -> dict[str, Any]:
    """epsilon-hat from per-canary scores (higher: more likely included) and the true inclusion
    bits. Ties are broken by a seeded permutation (a score that cannot tell canaries apart guesses
    at random). Returns eps_hat, the guesses that gave it (r, v, k_plus, k_minus), m, delta,
    confidence and the number of guess counts tried (the Bonferroni factor)."""
    scores, included = np.asarray(scores, dtype=float), np.asarray(included, dtype=bool)
    m = len(scores)
    if m == 0 or included.shape != scores.shape:
        raise VeilError(
            f"one-run audit needs one score per canary and as many inclusion bits, got {m} and {included.shape}"
        )
    if not np.all(np.isfinite(scores)):
        raise VeilError("one-run audit scores must be finite")
    perm = np.random.default_rng(seed).permutation(m)
    order = perm[np.argsort(-scores[perm], kind="stable")]  # highest first, ties in random order
    ranked = included[order]
    pairs = guess_counts(m, fractions)
    per_test = 1.0 - (1.0 - confidence) / len(pairs)
    best: dict[str, Any] = {"eps_hat": 0.0, "r": 0, "v": 0, "k_plus": 0, "k_minus": 0}
    for kp, km in pairs:
        v = int(ranked[:kp].sum()) + (int((~ranked[m - km :]).sum()) if km else 0)
        eps = epsilon_lower_bound(m, kp + km, v, delta, per_test)
        if eps > best["eps_hat"]:
            best = {"eps_hat": eps, "r": kp + km, "v": v, "k_plus": kp, "k_minus": km}
    return {
        **best,
        "m": m,
        "included": int(included.sum()),
        "delta": delta,
        "confidence": confidence,
        "tests": len(pairs),
    }


def max_epsilon(
    m: int, delta: float, confidence: float = 0.95, fractions: tuple[float, ...] = GUESS_FRACTIONS
) -> float:
    """The largest epsilon-hat `audit` can report with m canaries (every guess right): the
    audit's ceiling, whatever the mechanism."""
    pairs = guess_counts(m, fractions)
    per_test = 1.0 - (1.0 - confidence) / len(pairs)
    return max(epsilon_lower_bound(m, kp + km, kp + km, delta, per_test) for kp, km in pairs)


def flagged(eps_hat: float, claimed: Any) -> bool:
    """Whether epsilon-hat exceeds the claimed epsilon: a broken mechanism (None / inf claims
    nothing to break)."""
    if claimed is None or claimed == "inf":
        return False
    c = float(claimed)
    return math.isfinite(c) and eps_hat > c
