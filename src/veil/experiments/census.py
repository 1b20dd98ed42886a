"""The audit's census of what the server sees (`veil.attacks.census`), per task and defense:
every exported tensor clean / noised (with its noise-to-signal ratio) / frozen / absent, and which
of the task's attacks read it in closed form. One defended step of the task's attacked batch size
on a test batch, at the weights the cells attack (the seeded init, or the first seed's trained
run), cached as census/TASK/DEFENSE.json and put in summary.json as
``tasks[task].census[defense] = {"counts": {...}, "tensors": {name: {...}}}``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from veil.attacks.census import census, summarize
from veil.attacks.harness import private_batches
from veil.build import build_run, load_run
from veil.experiments.cells import make_attack
from veil.experiments.scenario import Scenario, Task, label
from veil.io import intact, write_checked_text


def census_path(out: Path, task: Task, defense: dict[str, Any]) -> Path:
    return out / "census" / task.name / f"{label(defense)}.json"


def task_attacks(s: Scenario, task: Task) -> dict[str, Any]:
    """The attacks the audit runs on `task` (its own, then the scenario's shared ones), by label."""
    entries = [*task.attacks, *[a for a in s.attacks if label(a) not in {label(x) for x in task.attacks}]]
    return {label(a): make_attack(a) for a in entries}


def census_all(s: Scenario, out: Path, run_dir: Callable[[Path, Task, dict[str, Any], int], Path]) -> None:
    """Compute (or reuse) the census of every single-step task x defense (first seed); a trained
    task's model is the one in ``run_dir(out, task, defense, seed)``."""

    seed = s.seeds[0]
    for task in s.tasks:
        if task.protocol != "single-step":
            continue
        attacks = task_attacks(s, task)
        for d in task.defenses:
            path = census_path(out, task, d)
            if path.is_file() and intact(path):
                continue
            if task.weights == "init":
                model, data, defenses = build_run(task.run_for(d, seed))
            else:
                _, model, data, defenses = load_run(run_dir(out, task, d, seed))
            size = int((task.knowledge or {}).get("batch_size") or 1)
            batch = private_batches(data.test, size, 1, seed)[0]
            entries = census(model, batch, defenses, attacks)
            for x in defenses:
                x.detach()
            path.parent.mkdir(parents=True, exist_ok=True)
            write_checked_text(path, json.dumps({"counts": summarize(entries), "tensors": entries}))


def attach_census(summary: dict[str, Any], s: Scenario, out: Path) -> None:
    """Put every cached census in ``summary["tasks"][task]["census"]``."""
    for task in s.tasks:
        t = (summary.get("tasks") or {}).get(task.name)
        if t is None or task.protocol != "single-step":
            continue
        t["census"] = {
            label(d): json.loads(p.read_text()) for d in task.defenses if (p := census_path(out, task, d)).is_file()
        }
