"""Section utility: test accuracy (or perplexity) per defense on pretrained / Hugging Face models,
and each defense's difference to undefended with its standard error, from
configs/paper/minilm_utility.yaml and its DP-SGD row, configs/paper/minilm_utility_dp.yaml
(`summary.tasks[t].utility`, `overhead`; the DP-SGD run's task merged into the same-named task)."""

from __future__ import annotations

from math import sqrt
from statistics import mean, stdev
from typing import Any

from results.notes import notes
from results.tables import mean_std, table

NOTES = notes(__name__)

SOURCES = ("minilm-utility", "minilm-utility-dp")
OPTIONAL = ("minilm-utility-dp",)  # rendered without it: the row says it is not collected yet
NOTE = NOTES["NOTE"]
#: the DP-SGD row, by label, while its run is not collected
DP_LABEL = "dpsgd(clip=1.0,noise_multiplier=0.1)"


def _row(name: str, t: dict[str, Any], d: str, base: list[float]) -> list[Any]:
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
    return [f"{name} ({t['model']})", d, len(acc), mean_std(acc, 100.0) if acc else "—", delta, se, within] + [
        mean_std(ppl, 1.0, 1) if ppl else "—",
        "—" if ratio is None else f"{ratio:.2f}",
    ]


def _rows(name: str, t: dict[str, Any]) -> list[list[Any]]:
    base = t["utility"].get("none", {}).get("test_accuracy_values", [])
    return [_row(name, t, d, base) for d in sorted(t["utility"], key=lambda d: (d != "none", d))]


def _merged(found: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The main run's tasks, each with the DP-SGD run's same-named task's defenses added."""
    tasks = {
        n: {**t, "utility": dict(t["utility"]), "overhead": dict(t.get("overhead", {}))}
        for n, t in found["minilm-utility"]["tasks"].items()
    }
    for n, t in found.get("minilm-utility-dp", {}).get("tasks", {}).items():
        tasks[n]["utility"].update(t["utility"])
        tasks[n]["overhead"].update(t.get("overhead", {}))
    return tasks


def render(found: dict[str, dict[str, Any]]) -> str:
    header = ["task", "defense", "seeds", "test accuracy (%)", "minus undefended (points)", "s.e. of that difference"]
    header += ["within 1 point", "test perplexity", "step time vs none"]
    rows = [r for name, t in _merged(found).items() for r in _rows(name, t)]
    if "minilm-utility-dp" not in found:
        rows.append(["sst2-minilm (minilm)", DP_LABEL, 0, NOTES["DP_PENDING"], "—", "—", "—", "—", "—"])
    title = "## Utility of MJP and AEGIS on pretrained / Hugging Face models"
    return f"{title}\n\n{NOTE.format(seeds=found['minilm-utility']['seeds'])}\n\n{table(header, rows)}"
