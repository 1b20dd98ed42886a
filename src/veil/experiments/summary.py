"""The audit's numbers with stable keys (summary.json); report.md and report.html are rendered
from this alone (`veil.report`), with the examples the engine hands beside it.

summary["tasks"][task]:
  utility[defense]          test_accuracy_mean / _std / values (+ test_perplexity_* for LMs;
                            + privacy: DP-SGD's epsilon, delta, noise multiplier, mode, accountant)
  leakage[defense][attack]  every metric, mean over seeds (each cell already averages samples)
  skipped[attack]           why an attack did not apply (to the model: decided before training)
  blocked[defense][attack]  why an attack could not run on a defended update (e.g. AEGIS froze
                            the layer it reads): the defense closed that channel
  overhead[defense]         step time relative to no defense; step_seconds[defense] absolute
  attacker_knows[attack]    what each attack uses (its `knows`: naive, or which part of the mechanism)
  worst_case[defense]       the verdict: the attack that rebuilt the most (veil.metrics.leakage),
                            keys attack, knows, metric, value, region, score, beside, ranking, blocked
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from veil.experiments.cells import cell_path, make_attack
from veil.experiments.scenario import Scenario, label
from veil.metrics.leakage import worst_case


def _mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def build_summary(
    s: Scenario,
    out: Path,
    cells: list[Any],
    utility: dict[str, Any],
    overhead: dict[str, Any],
    versions: dict[str, str],
) -> dict[str, Any]:
    """The single-step tasks' entries (see the module doc) from their cells' files and training summaries."""
    tasks: dict[str, Any] = {}
    for task in s.tasks:
        t: dict[str, Any] = {
            "model": task.run.model["name"],
            "data": task.run.data["name"],
            "protocol": task.protocol,
            "dropout": float(task.run.model.get("dropout", 0.0) or 0.0),
            "knowledge": task.knowledge,
            "samples": task.samples,
            "utility": {},
            "leakage": {},
            "skipped": {},
            "blocked": {},
            "overhead": {},
            "step_seconds": {},
            "attacker_knows": {},
            "worst_case": {},
        }
        for d, runs in utility[task.name].items():
            u: dict[str, Any] = {}
            for key in ("test_accuracy", "test_perplexity"):
                vals = [r[key] for r in runs if key in r]
                if vals:
                    m, sd = _mean_std(vals)
                    u.update({f"{key}_mean": m, f"{key}_std": sd, f"{key}_values": vals})
            u["train_seconds_mean"] = statistics.fmean(r["train_seconds"] for r in runs)
            privacy = [r["privacy"] for r in runs if r.get("privacy")]
            if privacy:  # DP-SGD: the accountant's epsilon (the largest over seeds) at delta
                u["privacy"] = max(privacy, key=lambda p: float(p["epsilon"]) if p.get("epsilon") is not None else -1.0)
            t["utility"][d] = u
        by_cell: dict[tuple[str, str], list[dict[str, float]]] = {}
        for c in cells:
            if c.task is not task:
                continue
            t["attacker_knows"][label(c.attack)] = make_attack(c.attack).knows
            if c.skipped:
                t["skipped"][label(c.attack)] = c.skipped
                continue
            result = json.loads(cell_path(out, c).read_text())
            if result.get("blocked"):
                t["blocked"].setdefault(label(c.defense), {})[label(c.attack)] = result["blocked"]
                continue
            by_cell.setdefault((label(c.defense), label(c.attack)), []).append(result["metrics"])
        for (d, a), rows in by_cell.items():
            keys = sorted(set().union(*rows))
            t["leakage"].setdefault(d, {})[a] = {k: statistics.fmean(r[k] for r in rows if k in r) for k in keys}
        for d in t["utility"]:
            t["worst_case"][d] = worst_case(t["leakage"].get(d, {}), t["attacker_knows"], t["blocked"].get(d))
        t["overhead"] = overhead[task.name]["ratio"]
        t["step_seconds"] = overhead[task.name]["seconds"]
        tasks[task.name] = t
    return {"scenario": s.name, "seeds": s.seeds, "tasks": tasks, "versions": versions, "config": s.raw}
