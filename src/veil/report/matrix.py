"""The report's first figure: per task a defense x attack matrix, one column per defense (its test
accuracy and the change against the undefended model in the first row), one row per attack, each
cell coloured by its verdict and holding the headline figure the verdict reads.

A cell's verdict (`cell_verdict`):

- the attack ran: the verdict of its own leakage (`veil.report.headline.verdict`: leaks / partly /
  holds), where `holds` stands only if the same attack rebuilt data (partly or better) on the
  undefended twin `none` of the task; otherwise `unknown` (a failed attack is not protection);
- the defense raised against the attack (it removed what the attack reads): `blocked`;
- the attack does not apply to the task or the cell (summary ``skipped`` or ``not_applicable``):
  `not applicable`;
- no entry at all: `not run`.

The figure: images, the PSNR in dB of the best-rebuilt region (`exact (∞)` for an identical copy);
text, the leakage score (share of the client's words the server holds + share rebuilt in place,
0-2), the column `score` of the per-attack text table; labels only, the label accuracy.
"""

from __future__ import annotations

import math
from typing import Any

from veil.metrics.leakage import cell_leakage, worst_case
from veil.report.headline import UNDEFENDED, reference, verdict
from veil.report.numbers import EXACT

#: the matrix's verdicts, in the order of its key
VERDICTS = ("leaks", "partly", "holds", "unknown", "blocked", "not applicable", "not run")


def css_class(v: str) -> str:
    """The HTML class of a verdict (`not applicable` -> `not-applicable`)."""
    return v.replace(" ", "-")


def attacks_of(t: dict[str, Any]) -> list[str]:
    """Every attack of a task, in the scenario's order (as the summary lists them)."""
    names: dict[str, None] = {}
    for a in t.get("attacker_knows", {}):
        names[a] = None
    for table in ("leakage", "blocked", "not_applicable"):
        for cells in t.get(table, {}).values():
            names.update(dict.fromkeys(cells))
    names.update(dict.fromkeys(t.get("skipped", {})))
    return list(names)


def figure(metrics: dict[str, Any]) -> str:
    """The headline figure of one cell's metrics (see the module doc); "" when nothing was measured."""
    cl = cell_leakage(metrics)
    if cl is None:
        return ""
    v = float(cl["value"])
    if cl["metric"].startswith("psnr"):
        return EXACT if math.isinf(v) else f"{v:.1f} dB"
    if cl["tier"] == 0:
        return f"labels {v:.2f}"
    return f"{float(cl['score']):.2f}"


def cell_verdict(t: dict[str, Any], d: str, a: str) -> tuple[str, str, str]:
    """(verdict, figure, why) of attack `a` against defense `d` in task entry `t`."""
    knows = t.get("attacker_knows", {})
    na = t.get("not_applicable", {}).get(d, {}).get(a) or t.get("skipped", {}).get(a)
    if na:
        return "not applicable", "n/a", str(na)
    if a in t.get("blocked", {}).get(d, {}):
        return "blocked", "blocked", str(t["blocked"][d][a])
    m = t.get("leakage", {}).get(d, {}).get(a)
    if m is None:
        return "not run", "—", "this attack did not run against this defense"
    v = verdict(worst_case({a: m}, knows))
    if v == "untested":
        return "unknown", "—", "the attack measured nothing"
    if v == "holds":
        twin = t.get("leakage", {}).get(UNDEFENDED, {}).get(a) if d != UNDEFENDED else None
        if twin is None or verdict(worst_case({a: twin}, knows)) not in ("leaks", "partly"):
            return "unknown", figure(m), "the attack failed on the undefended model too: its failure here says nothing"
    return v, figure(m), ""


def accuracy_cell(t: dict[str, Any], d: str) -> str:
    """`0.928` and, beside the reference, the change in points: `0.720 (+0.2 pts)`."""
    u = t["utility"].get(d, {})
    if "test_accuracy_mean" not in u:
        return "not trained"
    acc = float(u["test_accuracy_mean"])
    ref = reference(t)
    if d == ref or ref is None or "test_accuracy_mean" not in t["utility"].get(ref, {}):
        return f"{acc:.3f}"
    delta = 100 * (acc - float(t["utility"][ref]["test_accuracy_mean"]))
    return f"{acc:.3f} ({'±0.0' if abs(delta) < 0.05 else f'{delta:+.1f}'} pts)"


def matrix_block(name: str, t: dict[str, Any]) -> tuple:
    """("matrix", title, defenses, accuracy row, rows [(attack, [(verdict, figure, why)])])."""
    defenses = list(t["utility"]) or list(t.get("leakage", {}))
    accuracy = [accuracy_cell(t, d) for d in defenses]
    rows = [(a, [cell_verdict(t, d, a) for d in defenses]) for a in attacks_of(t)]
    return ("matrix", f"`{name}` — {t['model']} on {t['data']}", defenses, accuracy, rows)


def matrix_markdown(block: tuple) -> list[str]:
    """The matrix as a Markdown table: `LEAKS 119.1 dB` per cell."""
    _, title, defenses, accuracy, rows = block
    lines = [f"**{title}**", "", "| attack | " + " | ".join(f"`{d}`" for d in defenses) + " |"]
    lines.append("|---|" + "---|" * len(defenses))
    lines.append("| *test accuracy (vs none)* | " + " | ".join(accuracy) + " |")
    for a, cells in rows:
        shown = [f"**{v.upper()}**" + (f" {f}" if f and f not in (v, "n/a", "—") else "") for v, f, _ in cells]
        lines.append(f"| `{a}` | " + " | ".join(shown) + " |")
    return [*lines, ""]
