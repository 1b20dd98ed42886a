"""Section mjp-table1-models: MJP Table I across architectures (ViT, Swin-style, ResNet-style CNN)
with and without MJP on digits, from configs/paper/mjp_table1_models.yaml
(`summary.tasks[t].utility`, `overhead`)."""

from __future__ import annotations

from typing import Any

from results.notes import notes
from results.tables import config_values, mean_std, scenario_tasks, table, within_points

NOTES = notes(__name__)

SOURCES = ("mjp-table1-models",)
#: the paper's ImageNet-1K top-1 (%) without and with MJP, by our task's architecture
PAPER = {"vit": ("DeiT-S", 79.8, 80.5), "swin": ("Swin-T", 81.3, 81.3), "cnn": ("ResNet-50", 79.3, 79.4)}
NOTE = NOTES["NOTE"]


def render(summary: dict[str, Any]) -> str:
    rows = []
    for name, t, _, labels in scenario_tasks(summary):
        base = t["utility"]["none"]["test_accuracy_values"]
        for d in labels:
            if d == "none":
                continue
            acc = t["utility"][d]["test_accuracy_values"]
            paper = PAPER.get(name)
            ratio = t.get("overhead", {}).get(d)
            rows.append(
                [f"{name} (`{t['model']}`)", d, len(acc), mean_std(base, 100.0), mean_std(acc, 100.0)]
                + within_points(acc, base, 1.0)
                + ["—" if ratio is None else f"{ratio:.2f}"]
                + ([f"{paper[0]}: {paper[1]} → {paper[2]}"] if paper else ["—"])
            )
    header = ["architecture (model)", "defense", "seeds", "undefended (%)", "MJP (%)", "MJP - undefended (points)"]
    header += ["within 1 point", "step time vs none", "paper (ImageNet-1K top-1)"]
    single = (
        " With one seed a difference of about 1 point is within the seed-to-seed spread of these small models: "
        "a row is a measurement, not a margin."
        if len(summary["seeds"]) == 1
        else " Accuracy: mean ± std over the seeds."
    )
    epochs = config_values(summary, "run", "train", "epochs")
    note = NOTE.format(epochs=epochs, seeds=summary["seeds"], single=single)
    return f"### MJP across architectures (Table I analogue)\n\n{note}\n\n{table(header, rows)}"
