"""Section budgets: every budgeted attack cell of every collected run (no cell may
spend more than 1.2x its stated budget); the over-budget list is each summary's own
(`over_budget`, computed by the engine), so the threshold lives in one place."""

from __future__ import annotations

import functools
from typing import Any

from results.notes import notes
from results.tables import fmt, table

NOTES = notes(__name__)

SOURCES = ("*",)  # every collected summary
INTRO = NOTES["INTRO"]
OUTRO = NOTES["OUTRO"]


def unrecorded(s: dict[str, Any]) -> list[str]:
    """'task / defense / attack' for each attack cell of a budgeted attack (a non-empty `budget()`)
    whose summary holds no budget account: collected before its engine recorded one."""
    out = []
    for task, t in (s.get("tasks") or {}).items():
        for d, row in (t.get("leakage") or {}).items():
            for a in row:
                if a.split("(")[0] in _budgeted() and a not in (t.get("budget") or {}).get(d, {}):
                    out.append(f"{task} / {d} / {a}")
    return out


@functools.cache
def _budgeted() -> frozenset[str]:
    """The registered attacks that declare a budget (closed-form ones declare {})."""
    from veil.registry import ATTACKS

    return frozenset(n for n in ATTACKS.names() if ATTACKS.create(n).budget())


def render(summaries: dict[str, dict[str, Any]]) -> str:
    rows, over, quiet, missing = [], [], [], []
    for source, s in summaries.items():
        n = len(rows)
        missing += [f"{source}: {c}" for c in unrecorded(s)]
        for task, t in (s.get("tasks") or {}).items():
            for d, row in (t.get("budget") or {}).items():
                for a, acc in row.items():
                    mx = acc.get("budget_used_max", acc["budget_used"])
                    stop = "yes" if acc.get("budget_stopped") else "no"
                    rows.append([source, task, d, a, fmt(acc["budget_used"]), fmt(mx), stop])
        over += [f"{source}: {c}" for c in s.get("over_budget") or []]
        if len(rows) == n:
            quiet.append(source)
    header = ["source", "task", "defense", "attack", "budget_used (mean)", "budget_used (max)", "stopped by the budget"]
    verdict = "Over budget (> 1.2x): " + "; ".join(over) + "." if over else "No cell over budget (> 1.2x)."
    if missing:
        verdict += " Budget not recorded (collected before its engine recorded one): " + "; ".join(missing) + "."
    if quiet:
        verdict += " No budgeted cell in: " + ", ".join(quiet) + "."
    return f"{INTRO}\n\n{table(header, rows)}\n\n{verdict}\n\n{OUTRO}"
