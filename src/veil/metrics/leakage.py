"""The audit's verdict: for each task x defense, the attack that rebuilt the most of the client's data.

A metric over metrics: it ranks the leakage records the attacks' scores produced, so the audit
engine, the federated and split audits and the report all read it from here (`fmt` is the
report's precision, the one ties are compared at).

A leakage figure is only as strong as its attacker, so the verdict is the strongest attack that
ran, naive or adaptive, never a chosen one. Attacks of one task share a modality; the ordering:

Images — the PSNR (dB, pixels in [0, 1]) of what the attacker rebuilt, in the best region the
  attack scores: ``psnr_unshuffled`` (the patches the defense left in place, rebuilt at their own
  positions) or ``psnr`` (the whole image, bounded by any order the defense hides). The higher
  wins; the region is named, with the share of samples rebuilt exactly (``psnr_exact``), its SSIM
  and the patch counts beside it. A cell where only some samples are exact averages them at
  ``EXACT_DB`` (the harness's rule), so one identified image never reads as an inf mean.
Text — the client's words plus their positions: ``bag`` = max(rouge1, presence_f1) (the share of
  the client's words the server holds, order ignored) plus ``token_recovery`` (the share rebuilt at
  its own position). A sentence rebuilt exactly scores 2, its bag of words alone 1, nothing 0.
  The reported metric is the bag metric, with token_recovery beside it.
Labels only (``label_accuracy``, no input rebuilt) rank below every attack that rebuilds input.

Ties: scores are compared at the report's precision (3 decimals) and PSNR above ``EXACT_DB`` (100 dB:
a copy exact to float32 rounding) counts as equal; a tie goes to the attack listed first in the
scenario (conventionally the naive one: it needed less knowledge).

An attack the defense blocked (it raised: the defense removed what it reads) is listed beside the
winner as blocked; a blocked or failed attack is never the verdict while another attack worked.
"""

from __future__ import annotations

import math
from typing import Any

#: image regions, best first when tied: (PSNR key, SSIM key, name)
IMAGE_REGIONS = (("psnr_unshuffled", "ssim_unshuffled", "unshuffled patches"), ("psnr", "ssim", "whole image"))
BAG = ("rouge1", "presence_f1")
IMAGE_BESIDE = ("psnr", "psnr_masked_set", "ssim_masked_set", "masked_patches", "moved_patches")
TEXT_BESIDE = ("token_recovery", "unshuffled_recovery", "exact_recovery", "bag_recall", "moved_tokens")
EXACT_DB = 100.0  # PSNR above this is an exact copy for ranking purposes
#: the keys of every worst_case entry in summary.json
KEYS = ("attack", "knows", "metric", "value", "region", "score", "beside", "ranking", "blocked")


def _num(metrics: dict[str, Any], key: str) -> float | None:
    v = metrics.get(key)
    return float(v) if isinstance(v, (int, float)) and not math.isnan(v) else None


def cell_leakage(metrics: dict[str, Any]) -> dict[str, Any] | None:
    """How much one attack rebuilt: {tier, score, metric, value, region, beside}; None if nothing measured.

    tier 1 rebuilds the input (image or text), tier 0 only the labels."""
    images = [(v, p, s, name) for p, s, name in IMAGE_REGIONS if (v := _num(metrics, p)) is not None]
    if images:
        v, p, s, region = max(images, key=lambda r: r[0])  # max keeps the first (unshuffled) on a tie
        beside = {k: metrics[k] for k in (f"{p}_exact", s, *IMAGE_BESIDE) if k != p and _num(metrics, k) is not None}
        return {"tier": 1, "score": v, "metric": p, "value": v, "region": region, "beside": beside}
    bags = [(v, k) for k in BAG if (v := _num(metrics, k)) is not None]
    in_place = _num(metrics, "token_recovery")
    if bags or in_place is not None:
        bag, key = max(bags) if bags else (0.0, "token_recovery")
        beside = {k: metrics[k] for k in TEXT_BESIDE if k != key and _num(metrics, k) is not None}
        value = bag if bags else float(in_place or 0.0)
        return {
            "tier": 1,
            "score": bag + (in_place or 0.0),
            "metric": key,
            "value": value,
            "region": "bag of words" if bags else "tokens in place",
            "beside": beside,
        }
    acc = _num(metrics, "label_accuracy")
    if acc is not None:
        return {
            "tier": 0,
            "score": acc,
            "metric": "label_accuracy",
            "value": acc,
            "region": "labels only",
            "beside": {},
        }
    return None


def worst_case(
    leakage: dict[str, dict[str, Any]], knows: dict[str, str], blocked: dict[str, str] | None = None
) -> dict[str, Any]:
    """The strongest attack against one defense: leakage[attack] = its metrics (see the module doc).

    ``ranking`` lists every attack that measured leakage, strongest first; ``blocked`` the attacks
    the defense stopped, with the reason. ``attack`` is None when no attack measured anything."""
    scored = [(a, c) for a, m in leakage.items() if (c := cell_leakage(m)) is not None]
    scored.sort(
        key=lambda ac: (ac[1]["tier"], round(min(ac[1]["score"], EXACT_DB), 3)), reverse=True
    )  # stable: scenario order breaks ties
    out: dict[str, Any] = dict.fromkeys(KEYS)
    out.update(ranking=[a for a, _ in scored], blocked=dict(blocked or {}), beside={})
    if scored:
        a, c = scored[0]
        out.update(
            attack=a, knows=knows.get(a, ""), **{k: c[k] for k in ("metric", "value", "region", "score", "beside")}
        )
    return out


def fmt(v: Any, digits: int = 3) -> str:
    """A number as the report prints it: `digits` decimals, whole numbers from 1000 up, inf; other values as text."""
    if isinstance(v, float):
        return "inf" if v == float("inf") else f"{v:.{digits}f}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def leak_text(wc: dict[str, Any], digits: int = 3, keep: tuple[str, ...] | None = None) -> str:
    """The winner's leakage in words: rouge1 0.960 (bag of words); token_recovery 0.990 (`keep`: only those beside)."""
    beside = ", ".join(f"{k} {fmt(float(v), digits)}" for k, v in wc["beside"].items() if keep is None or k in keep)
    return f"{wc['metric']} {fmt(float(wc['value']), digits)} ({wc['region']})" + (f"; {beside}" if beside else "")


def describe(wc: dict[str, Any], digits: int = 3, keep: tuple[str, ...] | None = None) -> str:
    """One line: `span-mjp`: rouge1 0.960 (bag of words); token_recovery 0.990."""
    if wc.get("attack") is None:
        return "no attack measured leakage"
    return f"`{wc['attack']}`: {leak_text(wc, digits, keep)}"
