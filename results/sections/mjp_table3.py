"""Section mjp-table3: MJP Table III analogue, semantic segmentation with and without MJP (pixel
accuracy, mIoU, mAcc) on digit mosaics, from configs/paper/mjp_table3_segmentation.yaml
(`summary.tasks[t].utility`: test_accuracy = pixel accuracy, test_miou, test_macc)."""

from __future__ import annotations

from typing import Any

from results.notes import notes
from results.tables import mean_std, scenario_tasks, table, within_points

NOTES = notes(__name__)

SOURCES = ("mjp-table3-segmentation",)
NOTE = NOTES["NOTE"]


def render(summary: dict[str, Any]) -> str:
    rows, meta = [], {}
    for _, t, entry, labels in scenario_tasks(summary):
        run = entry.get("run", {})
        meta = {"epochs": run.get("train", {}).get("epochs", "?")}
        data = run.get("data") if isinstance(run.get("data"), dict) else {}
        meta.update(train=data.get("train_size", 2000), test=data.get("test_size", 500))
        base = t["utility"]["none"].get("test_miou_values", [])
        for d in labels:
            u = t["utility"][d]
            miou = u.get("test_miou_values", [])
            rows.append(
                [f"`{t['model']}` on `{t['data']}`", d, len(miou), mean_std(u["test_accuracy_values"], 100.0)]
                + [mean_std(miou, 100.0), mean_std(u.get("test_macc_values", []), 100.0)]
                + (["—", "—"] if d == "none" else within_points(miou, base, 1.0))
            )
    header = [
        "task",
        "defense",
        "seeds",
        "pixel accuracy (%)",
        "mIoU (%)",
        "mAcc (%)",
        "mIoU minus undefended (points)",
    ]
    header += ["within 1 point"]
    note = NOTE.format(seeds=summary["seeds"], **meta)
    return f"### Segmentation with and without MJP (Table III analogue)\n\n{note}\n\n{table(header, rows)}"
