"""The report's first section, "At a glance": per task, per defense one line with its accuracy
cost against `none` and its worst-case leakage (the strongest attack that ran, its figure, and a
plain verdict, coloured in the HTML).

The verdict reads the worst case the audit already chose (`veil.metrics.leakage.worst_case`):

- images, by the PSNR (dB, pixels in [0, 1]) of the best-rebuilt region: `leaks` from
  `IMAGE_BANDS[1]` up (the image is recognisable: RMS error about 0.1 of the pixel range or less),
  `partly` from `IMAGE_BANDS[0]` (blurred or partial: strokes, unshuffled patches), `holds`
  below (about what an image of the data's mean pixels scores);
- text, by the worst case's score, the share of the client's words the server holds plus the share
  rebuilt in place (0-2): `leaks` from `TEXT_BANDS[1]` up (most words known), `partly` from
  `TEXT_BANDS[0]`, `holds` below;
- labels only (no attack rebuilt any input): `partly`, the labels leak;
- no attack measured anything: `holds` when the defense blocked the attacks, `untested` otherwise;
- a failed attack is not protection (`task_verdict`): `holds` stands only where an attack that
  failed or was blocked against the defense rebuilt data (`partly` or better) on the undefended
  twin of the same task (`none`: same data, same budget); otherwise the verdict is `unknown`, and
  so is `none`'s own `holds` (the attacks failed on the undefended model).

`holds` is never "protected": it says these attacks, at these budgets and with this knowledge,
failed; a stronger attacker (more iterations or restarts, a larger batch of guesses, knowledge of
the defense, a malicious server) may not, and the line says so.
"""

from __future__ import annotations

import math
from typing import Any

from veil.metrics.leakage import EXACT_DB, fmt, worst_case

IMAGE_BANDS = (12.0, 20.0)  #: PSNR dB: (partly from, leaks from)
TEXT_BANDS = (0.3, 0.8)  #: words + words in place: (partly from, leaks from)

SAYS = {
    "leaks": "the server rebuilds the client's data",
    "partly": "part of the client's data comes back; a stronger attacker may get more",
    "holds": "holds against the attacks run; a stronger or adaptive attacker may still get through",
    "untested": "no attack measured leakage here: untested, not safe",
    "unknown": "unknown: the attack failed on the undefended model too, so its failure here says nothing",
}
UNDEFENDED = "none"


def verdict(wc: dict[str, Any] | None) -> str:
    """leaks / partly / holds / untested for one worst-case entry (see the module doc)."""
    if not wc or wc.get("attack") is None:
        return "holds" if wc and wc.get("blocked") else "untested"
    if wc["metric"] == "label_accuracy":
        return "partly"
    if float(wc["beside"].get(f"{wc['metric']}_exact", 0.0)) > 0:
        return "leaks"  # one sample rebuilt exactly is a leak, whatever the mean over the others
    score = float(wc["score"])
    lo, hi = IMAGE_BANDS if wc["metric"].startswith("psnr") else TEXT_BANDS
    return "leaks" if score >= hi else "partly" if score >= lo else "holds"


def task_verdict(t: dict[str, Any], d: str) -> str:
    """The verdict of defense `d` in task entry `t`: `verdict` of its worst case, where `holds`
    becomes `unknown` unless an attack that failed (or was blocked) against `d` succeeded, `partly`
    or better, on the undefended twin `none` of the same task."""
    wc = t.get("worst_case", {}).get(d)
    v = verdict(wc)
    if v != "holds":
        return v
    tried = list((wc or {}).get("ranking") or []) + list((wc or {}).get("blocked") or {})
    twin = t.get("leakage", {}).get(UNDEFENDED, {}) if d != UNDEFENDED else {}
    knows = t.get("attacker_knows", {})
    worked = [a for a in tried if a in twin and verdict(worst_case({a: twin[a]}, knows)) in ("leaks", "partly")]
    return "holds" if worked else "unknown"


def reference(t: dict[str, Any]) -> str | None:
    """The defense the accuracy cost is measured against: `none`, else the first one listed."""
    return "none" if "none" in t["utility"] else next(iter(t["utility"]), None)


def cost_text(t: dict[str, Any], d: str) -> str:
    """Accuracy and its change against the reference, in points, and the weights attacked where the
    summary records them: `accuracy 0.915 (-1.2 pts vs none), final model at step 120`."""
    return _cost(t, d) + _weights(t["utility"][d].get("weights"))


def _weights(w: Any) -> str:
    """`, final model at step 120` (steps per seed, joined) from utility's ``weights``; "" if absent."""
    if not isinstance(w, dict) or w.get("checkpoint") != "final" or not w.get("steps"):
        return ""
    return f", final model at step {' / '.join(str(s) for s in dict.fromkeys(w['steps']))}"


def _cost(t: dict[str, Any], d: str) -> str:
    if "test_accuracy_mean" not in t["utility"][d]:  # a task attacked at its initial weights trains nothing
        return "not trained (attacked at its initial weights)"
    acc = float(t["utility"][d]["test_accuracy_mean"])
    ref = reference(t)
    if d == ref:
        return f"accuracy {acc:.3f} (the reference)"
    if "test_accuracy_mean" not in t["utility"][ref]:
        return f"accuracy {acc:.3f}"
    delta = 100 * (acc - float(t["utility"][ref]["test_accuracy_mean"]))
    return f"accuracy {acc:.3f} ({'±0.0' if abs(delta) < 0.05 else f'{delta:+.1f}'} pts vs {ref})"


def leak_line(wc: dict[str, Any] | None) -> str:
    """The worst case in a few words: `april`: psnr 119.1 dB (whole image)."""
    if not wc or wc.get("attack") is None:
        blocked = ", ".join((wc or {}).get("blocked") or {})
        return f"every attack blocked ({blocked})" if blocked else "no attack measured leakage"
    v = float(wc["value"])
    if wc["metric"].startswith("psnr"):
        share = wc["beside"].get(f"{wc['metric']}_exact")
        region = f"{wc['region']}: an identical copy" if math.isinf(v) else wc["region"]
        if share is not None and 0 < float(share) < 1:
            region += f"; {100 * float(share):.0f} % of samples exact, averaged at {fmt(EXACT_DB, 0)} dB"
        return f"`{wc['attack']}`: {wc['metric']} {fmt(v, 1)} dB ({region})"
    if wc["metric"] == "label_accuracy":
        return f"`{wc['attack']}`: label accuracy {fmt(v)} (labels only)"
    in_place = wc["beside"].get("token_recovery")
    extra = f", {fmt(float(in_place))} in place" if in_place is not None and wc["metric"] != "token_recovery" else ""
    return f"`{wc['attack']}`: {wc['metric']} {fmt(v)} ({wc['region']}{extra})"


def glance_blocks(summary: dict[str, Any]) -> list[tuple]:
    """("h2", "At a glance"), a key to the verdicts, then per task ("glance", title, rows) with
    rows = [defense, cost, leakage, verdict, what the verdict says]."""
    blocks: list[tuple] = [
        ("h2", "At a glance"),
        (
            "p",
            "Per task and defense: the accuracy cost against `none` and the worst case, the attack that rebuilt the "
            "most of a client's data. Verdicts: leaks (images from "
            f"{IMAGE_BANDS[1]:g} dB PSNR or any image rebuilt exactly, text from {TEXT_BANDS[1]:g} of words + words in place), partly (from "
            f"{IMAGE_BANDS[0]:g} dB / {TEXT_BANDS[0]:g}, or labels only), holds (below: these attacks failed at these "
            "budgets, which a stronger attacker may not, and the same attack rebuilt data on the undefended model), "
            "unknown (the attacks that failed here failed on the undefended model too: no evidence either way).",
        ),
    ]
    for name, t in summary["tasks"].items():
        rows = []
        for d in t["utility"]:
            wc = t.get("worst_case", {}).get(d)
            v = task_verdict(t, d)
            rows.append([d, cost_text(t, d), leak_line(wc), v, SAYS[v]])
        blocks.append(("glance", f"`{name}` — {t['model']} on {t['data']}", rows))
    return blocks
