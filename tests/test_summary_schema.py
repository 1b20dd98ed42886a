"""summary.json is typed (`veil.experiments.summary_schema`) and versioned (``schema``): every key
an engine writes into a task entry or the top level is declared there."""

from __future__ import annotations

from pathlib import Path

from veil.experiments.audit import run_audit
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


def test_a_single_step_audit_writes_only_declared_keys(tmp_path: Path) -> None:
    tiny = {
        "name": "tiny",
        "tasks": [
            {
                "name": "init",
                "run": {
                    "model": {"name": "vit-digits", "dim": 16, "depth": 1, "heads": 2},
                    "data": {"name": "digits", "train_size": 64, "test_size": 32},
                },
                "weights": "init",
                "defenses": ["none"],
                "attacks": ["labels"],
                "samples": 1,
            }
        ],
    }
    summary = run_audit(parse_scenario(tiny), tmp_path / "out", progress=False, jobs=1)
    assert summary["schema"] == SCHEMA and set(summary) <= summary_keys()
    assert set(summary["tasks"]["init"]) <= task_keys(), sorted(set(summary["tasks"]["init"]) - task_keys())
    assert summary["tasks"]["init"]["leakage"]["none"]["labels"]["label_accuracy"] >= 0.0
