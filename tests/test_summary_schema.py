"""summary.json is typed (`veil.experiments.summary_schema`) and versioned (``schema``): every key
an engine writes into a task entry or the top level is declared there."""

from __future__ import annotations

from pathlib import Path

from veil.experiments.scenario import Scenario, parse_scenario
from veil.experiments.summary import build_summary, task_entry
from veil.experiments.summary_schema import SCHEMA, summary_keys, task_keys

TASK = {"name": "t", "run": {"model": "vit-digits", "data": "digits"}}
#: the tables each engine adds to the common ones (experiments.summary, fedavg / split / dp-audit)
ENGINE_TABLES = [("budget",), ("budget", "rounds", "clients", "bytes"), ("budget", "split"), ("dp_audit", "membership")]


def test_every_engine_table_is_declared() -> None:
    task = parse_scenario({"tasks": [TASK]}).tasks[0]
    for tables in ENGINE_TABLES:
        about = {"weights": "trained", "reference": "original", "canaries": {}}
        entry = task_entry(task, 1, about=about, tables=tables)
        assert set(entry) <= task_keys(), sorted(set(entry) - task_keys())
    assert {"census", "worst_case", "leakage", "utility"} <= task_keys()


def test_the_summary_carries_its_schema(tmp_path: Path) -> None:
    s = Scenario(name="empty", seeds=[0], tasks=[], raw={})
    summary = build_summary(s, tmp_path, [], {}, {}, {"veil": "0"})
    assert summary["schema"] == SCHEMA == 1
    assert set(summary) | {"over_budget"} <= summary_keys()
