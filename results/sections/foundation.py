"""Section foundation: the reference training runs (configs/vit_digits.yaml, configs/minilm_sst2.yaml)
trained by the audit engine from configs/paper/foundation.yaml. The per-preset step times below it
(section foundation-bench) are a benchmark's (benchmarks/train_step.py), not the engine's."""

from __future__ import annotations

from typing import Any

from results.notes import notes
from results.tables import table

NOTES = notes(__name__)

#: task -> (the config it mirrors, the accuracy goal, the training-time goal in minutes)
GOALS = {"vit-digits": ("configs/vit_digits.yaml", 0.97, 5), "minilm-sst2": ("configs/minilm_sst2.yaml", 0.85, 15)}
MINILM = NOTES["MINILM"]


def render(summary: dict[str, Any]) -> str:
    rows = []
    for name, t in summary["tasks"].items():
        config, acc_goal, minutes = GOALS[name]
        u = t["utility"]["none"]
        acc, train_min = u["test_accuracy_mean"], u["train_seconds_mean"] / 60
        met = "met" if acc >= acc_goal else "**not met**"
        timed = "met" if train_min < minutes else "not met here (a shared machine's time: see the note)"
        rows.append(
            [f"`{config}`", t["model"], t["data"], f"{acc:.4f}", f"{train_min:.1f} min"]
            + [f"accuracy >= {acc_goal:g}: {met}; < {minutes} min: {timed}"]
        )
    header = ["run (same settings)", "model", "data", "test accuracy", "training time", "goal"]
    note = (
        "Trained by `veil audit configs/paper/foundation.yaml` (the settings of the config, one torch thread), "
        "rendered by `python -m results`; never edit by hand. Training time is the engine's wall time on this "
        "shared 2-core machine, as loaded as it was during the run (the goal's minutes are for a machine the run has to "
        "itself): indicative only; step times on a quiet machine are the benchmark below."
    )
    return f"## Foundation\n\n{note}\n\n{table(header, rows)}\n\n{MINILM}"
