"""Section pfesta-pretrained: p-FeSTA with a pretrained frozen head beside SL and FeSTA (issue 19:
"classification within 3 points of SL"), from configs/paper/pfesta_pretrained_head.yaml
(split tasks: `utility[protocol]` = the classify accuracy, `split`, `leakage` of the feature attacks)."""

from __future__ import annotations

from typing import Any

from results.notes import notes
from results.tables import config_values, fmt, mean_std, scenario_tasks, table, within_points

NOTES = notes(__name__)

SOURCES = ("pfesta-pretrained-head",)
NOTE = NOTES["NOTE"]


def render(summary: dict[str, Any]) -> str:
    rows = []
    attacks = sorted({a for t in summary["tasks"].values() for leak in t["leakage"].values() for a in leak})
    for name, t, _, labels in scenario_tasks(summary):
        sl = t["utility"].get("sl", {}).get("test_accuracy_values")
        for d in labels:
            acc = t["utility"][d]["test_accuracy_values"]
            diff = within = "—"
            if sl and d != "sl":
                diff, within = within_points(acc, sl, 3.0)
                within = within if d.startswith("pfesta") else "—"
            leak = t["leakage"].get(d, {})
            e = t["split"].get(d, {})
            mb = e.get("bytes_per_client")
            rows.append(
                [name, d, len(acc), mean_std(acc, 100.0), diff, within, "—" if mb is None else f"{mb / 1e6:.2f} MB"]
                + [fmt(leak[a]["psnr"], 2) if a in leak else "—" for a in attacks]
            )
    header = ["start", "protocol", "seeds", "classify accuracy (%)", "minus SL (points)", "within 3 points of SL"]
    header += ["bytes / client", *[f"PSNR `{a}`" for a in attacks]]
    note = NOTE.format(epochs=config_values(summary, "federated", "epochs"), seeds=summary["seeds"])
    return f"### p-FeSTA with a pretrained frozen head\n\n{note}\n\n{table(header, rows)}"
