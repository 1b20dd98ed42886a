"""The audit's numbers with stable keys (summary.json, typed in `veil.experiments.summary_schema`,
its version as ``summary["schema"]``); report.md and report.html are rendered from this alone
(`veil.report`), with the examples the engine hands beside it.

summary["tasks"][task]:
  utility[defense]          weights: the weights attacked ({checkpoint: final | init, steps: per seed}),
                            test_accuracy_mean / _std / values (+ test_perplexity_* for LMs,
                            test_miou_* / test_macc_* for segmentation, where test_accuracy is pixel accuracy;
                            + privacy: DP-SGD's epsilon, delta, noise multiplier, mode, accountant)
  leakage[defense][attack]  every metric, mean over seeds (each cell already averages samples)
  skipped[attack]           why an attack did not apply (to the model: decided before training)
  blocked[defense][attack]  why an attack could not run on a defended update (e.g. AEGIS froze
                            the layer it reads): the defense closed that channel
  overhead[defense]         step time relative to no defense (median over interleaved steps);
                            overhead_spread[defense] the quartiles of the step-by-step ratios;
                            step_seconds[defense] absolute
  attacker_knows[attack]    what each attack uses (its `knows`: naive, or which part of the mechanism)
  worst_case[defense]       the verdict: the attack that rebuilt the most (veil.metrics.leakage),
                            keys attack, knows, metric, value, region, score, beside, ranking, blocked
  budget[defense][attack]   a budgeted attack's account (`veil.attacks.base.Attack.budget`):
                            budget_used (mean over samples and seeds; 1.0 = the whole budget),
                            budget_used_max (the most one sample spent), budget_stopped (any)
  census[defense]           what the server sees: every parameter clean / noised (nsr) / frozen /
                            absent, with the attacks that read it (`veil.experiments.census`)
summary["over_budget"]      the cells whose budget_used_max exceeds OVER_BUDGET (`over_budget`)

`python -m veil.experiments.summary AUDIT_DIR` prints every budgeted cell's account from its
summary.json and exits 1 when a cell is over budget.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

from veil.experiments.cells import cell_path, make_attack
from veil.experiments.scenario import Scenario, Task, label
from veil.experiments.summary_schema import SCHEMA, AuditSummary, TaskSummary
from veil.metrics.leakage import worst_case

#: a cell whose attack did more than this many times its stated budget is over budget: no cell may
#: exceed its budget by more than a fifth
OVER_BUDGET = 1.2


def _mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def task_entry(
    task: Task,
    samples: int,
    *,
    dropout: float | None = None,
    about: dict[str, Any] | None = None,
    skipped: dict[str, str] | None = None,
    attacker_knows: dict[str, str] | None = None,
    tables: tuple[str, ...] = (),
) -> TaskSummary:
    """A task's summary entry before its numbers: what was trained and attacked, then the tables
    every engine fills (see the module doc), empty. `dropout` defaults to the model config's;
    `about` follows `samples` (the single-step tasks' weights and reference); `tables` are the
    engine's own, after the common ones (budget; rounds, clients, bytes; split)."""
    if dropout is None:
        dropout = float(task.run.model.get("dropout", 0.0) or 0.0)
    return {  # `about` and `tables` name keys of TaskSummary
        "model": task.run.model["name"],
        "data": task.run.data["name"],
        "protocol": task.protocol,
        "dropout": dropout,
        "knowledge": task.knowledge,
        "samples": samples,
        **(about or {}),
        "utility": {},
        "leakage": {},
        "skipped": {} if skipped is None else skipped,
        "blocked": {},
        "overhead": {},
        "step_seconds": {},
        "attacker_knows": {} if attacker_knows is None else attacker_knows,
        "worst_case": {},
        **{name: {} for name in tables},
    }


def build_summary(
    s: Scenario,
    out: Path,
    cells: list[Any],
    utility: dict[str, Any],
    overhead: dict[str, Any],
    versions: dict[str, str],
) -> AuditSummary:
    """The single-step tasks' entries (see the module doc) from their cells' files and training summaries."""
    tasks: dict[str, TaskSummary] = {}
    for task in s.tasks:
        t = task_entry(
            task, task.samples, about={"weights": task.weights, "reference": task.reference}, tables=("budget",)
        )
        for d, runs in utility[task.name].items():
            u: dict[str, Any] = {}
            if not runs:  # attacked at its initial weights: nothing trained
                t["utility"][d] = {"weights": {"checkpoint": "init", "steps": [0]}}
                continue
            u["weights"] = {"checkpoint": "final", "steps": [r["steps"] for r in runs if "steps" in r]}
            for key in ("test_accuracy", "test_perplexity", "test_miou", "test_macc"):
                vals = [r[key] for r in runs if key in r]
                if vals:
                    m, sd = _mean_std(vals)
                    u.update({f"{key}_mean": m, f"{key}_std": sd, f"{key}_values": vals})
            u["train_seconds_mean"] = statistics.fmean(r["train_seconds"] for r in runs)
            evals = [r["evaluations"] for r in runs if r.get("evaluations")]
            if evals:  # mean over seeds of each evaluation's numbers (veil.experiments.evaluations)
                u["evaluations"] = {
                    name: {k: statistics.fmean(e[name][k] for e in evals) for k in evals[0][name]} for name in evals[0]
                }
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
            t["leakage"].setdefault(d, {})[a] = m = {k: statistics.fmean(r[k] for r in rows if k in r) for k in keys}
            if (acc := budget_rollup(rows)) is not None:  # over seeds as over samples: mean, the most, any
                m.update(acc)
                t["budget"].setdefault(d, {})[a] = acc
        for d in t["utility"]:
            t["worst_case"][d] = worst_case(t["leakage"].get(d, {}), t["attacker_knows"], t["blocked"].get(d))
        t["overhead"] = overhead.get(task.name, {}).get("ratio", {})
        t["step_seconds"] = overhead.get(task.name, {}).get("seconds", {})
        t["overhead_spread"] = overhead.get(task.name, {}).get("ratio_spread", {})
        tasks[task.name] = t
    return {
        "schema": SCHEMA,
        "scenario": s.name,
        "seeds": s.seeds,
        "tasks": tasks,
        "versions": versions,
        "config": s.raw,
    }


def budget_rollup(rows: list[dict[str, float]]) -> dict[str, float] | None:
    """One cell's budget account over its samples / rounds / seeds (`budget_metrics` rows): the
    mean ``budget_used``, the most one of them spent, whether the budget stopped any; None when no
    row is budgeted (a closed-form attack)."""
    used = [float(r["budget_used"]) for r in rows if "budget_used" in r]
    if not used:
        return None
    return {
        "budget_used": statistics.fmean(used),
        "budget_used_max": max(float(r.get("budget_used_max", r["budget_used"])) for r in rows if "budget_used" in r),
        "budget_stopped": float(any(r.get("budget_stopped", 0.0) for r in rows)),
    }


def over_budget(summary: dict[str, Any], limit: float = OVER_BUDGET) -> list[str]:
    """'task / defense / attack: budget_used X' for every cell whose attack spent more than `limit`
    times its stated budget on some sample (none, when every attack keeps its budget)."""
    return [
        f"{task} / {d} / {a}: budget_used {acc.get('budget_used_max', acc['budget_used']):.3f}"
        for task, t in summary.get("tasks", {}).items()
        for d, row in (t.get("budget") or {}).items()
        for a, acc in row.items()
        if acc.get("budget_used_max", acc["budget_used"]) > limit
    ]


def budget_table(summary: dict[str, Any]) -> str:
    """A markdown table of every budgeted cell's account (task, defense, attack, mean / max
    budget_used, stopped by the budget), then one line naming the cells over budget, if any."""
    lines = [
        "| task | defense | attack | budget_used (mean) | budget_used (max) | stopped by the budget |",
        "|---|---|---|---|---|---|",
    ]
    for task, t in summary.get("tasks", {}).items():
        for d, row in (t.get("budget") or {}).items():
            for a, acc in row.items():
                mx = acc.get("budget_used_max", acc["budget_used"])
                stop = "yes" if acc.get("budget_stopped") else "no"
                lines.append(f"| {task} | {d} | {a} | {acc['budget_used']:.3f} | {mx:.3f} | {stop} |")
    over = over_budget(summary)
    lines.append(
        f"over budget (> {OVER_BUDGET:g}x): " + "; ".join(over) if over else f"no cell over budget (> {OVER_BUDGET:g}x)"
    )
    return "\n".join(lines)


if __name__ == "__main__":  # python -m veil.experiments.summary AUDIT_DIR
    if len(sys.argv) != 2 or not (Path(sys.argv[1]) / "summary.json").is_file():
        print("usage: python -m veil.experiments.summary AUDIT_DIR (a folder holding summary.json)", file=sys.stderr)
        sys.exit(2)
    found = json.loads((Path(sys.argv[1]) / "summary.json").read_text())
    print(budget_table(found))
    sys.exit(1 if over_budget(found) else 0)
