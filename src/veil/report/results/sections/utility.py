"""Section utility: test accuracy (or perplexity) per defense on pretrained / Hugging Face models,
and each defense's difference to undefended with its standard error, from
configs/paper/minilm_utility.yaml (`summary.tasks[t].utility`, `overhead`)."""

from __future__ import annotations

from math import sqrt
from statistics import mean, stdev
from typing import Any

from veil.report.results.notes import notes
from veil.report.results.tables import mean_std, table

NOTES = notes(__name__)

SOURCES = ("minilm-utility",)
NOTE = NOTES["NOTE"]


def _rows(name: str, t: dict[str, Any]) -> list[list[str]]:
    base = t["utility"].get("none", {}).get("test_accuracy_values", [])
    rows = []
    for d in sorted(t["utility"], key=lambda d: (d != "none", d)):
        u = t["utility"][d]
        acc, ppl = u.get("test_accuracy_values", []), u.get("test_perplexity_values", [])
        delta = se = within = "—"
        if d != "none" and base and acc:
            diff = 100 * (mean(acc) - mean(base))
            delta, within = f"{diff:+.2f}", ("yes" if diff >= -1.0 else "no")
            if len(acc) > 1 and len(base) > 1:
                se = f"{100 * sqrt(stdev(acc) ** 2 / len(acc) + stdev(base) ** 2 / len(base)):.2f}"
        within = "—" if ppl else within  # the 1-point goal is on classification accuracy
        ratio = t.get("overhead", {}).get(d)
        rows.append(
            [f"{name} ({t['model']})", d, len(acc), mean_std(acc, 100.0) if acc else "—", delta, se, within]
            + [mean_std(ppl, 1.0, 1) if ppl else "—", "—" if ratio is None else f"{ratio:.2f}"]
        )
    return rows


def render(summary: dict[str, Any]) -> str:
    header = ["task", "defense", "seeds", "test accuracy (%)", "minus undefended (points)", "s.e. of that difference"]
    header += ["within 1 point", "test perplexity", "step time vs none"]
    rows = [r for name, t in summary["tasks"].items() for r in _rows(name, t)]
    title = "## Utility of MJP and AEGIS on pretrained / Hugging Face models"
    return f"{title}\n\n{NOTE.format(seeds=summary['seeds'])}\n\n{table(header, rows)}"
