"""Section budgets: every budgeted attack cell of every collected run (issue 23: no cell may
spend more than 1.2x its stated budget); the over-budget list is each summary's own
(`over_budget`, computed by the engine), so the threshold lives in one place."""

from __future__ import annotations

from typing import Any

from veil.report.results.tables import fmt, table

SOURCES = ("*",)  # every collected summary
INTRO = """## Attack budgets (issue 23)

Every attack declares its budget in counted work (`Attack.budget()`: iterations x restarts for
IG / DLG / ig-fedavg / TAG / LAMP, Levenberg-Marquardt (or L-BFGS) iterations x restarts for
`april-mjp`, sentences scored for `span` / `span-mjp`, training steps for the feature attacks; `{}`
for the closed-form attacks, whose work the input fixes: april, labels, presence,
presence-adaptive, presence-average, head-embedding, span-unfrozen, span-robust). Each cell of the
audit carries `budget_used` (work / budget, mean over samples), `budget_used_max` and
`budget_stopped` in summary.json (`tasks[t].budget`, and `over_budget` lists the cells past 1.2x;
`python -m veil.experiments.summary RUN_DIR` prints the same check for one run). Rendered from
every run collected under docs/results/ (source = the collected file):"""
OUTRO = """The span attack's searches cut each scoring call at what is left of the budget (transformer4
width 96, depth 3, 8 SST-2 sentences of <= 24 tokens, budget 5,000: 5,000 scored, was 5,232 when the
peeling walkers checked between sweeps; tests/test_span_budget.py); every budgeted attack stops at
its budget exactly. A source with no row has no budgeted cell (closed-form attacks only, or a
protocol that reports no budget)."""


def render(summaries: dict[str, dict[str, Any]]) -> str:
    rows, over, quiet = [], [], []
    for source, s in summaries.items():
        n = len(rows)
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
    if quiet:
        verdict += " No budgeted cell in: " + ", ".join(quiet) + "."
    return f"{INTRO}\n\n{table(header, rows)}\n\n{verdict}\n\n{OUTRO}"
