"""Section aegis-down: the MLP down-projection channel of AEGIS, attacked by `span-down` with no
candidate pool, under AEGIS as published and under veil's default (configs/paper/aegis_down.yaml),
with what closing it costs MiniLM on SST-2 (configs/paper/minilm_utility.yaml: the published
recipe beside the down-projection noised)."""

from __future__ import annotations

from typing import Any

from results.notes import notes
from results.tables import fmt, scenario_tasks, table

NOTES = notes(__name__)

SOURCES = ("aegis-down", "minilm-utility")
#: MiniLM on SST-2, AEGIS at lr_scale 3 (the screened recipe): published vs the down-projection noised
COST = ("aegis(lr_scale=3.0)", "aegis(lr_scale=3.0,mlp_down_noise=1.0)", "aegis(lr_scale=3.0,mlp_down_noise=0.3)")


def recipe(d: str) -> str:
    """Which AEGIS recipe a defense label is."""
    return "as published" if "mlp_down_noise=0.0" in d else "veil's default" if d == "aegis" else d


def attack_table(summary: dict[str, Any]) -> str:
    rows = []
    for name, t, _, defenses in scenario_tasks(summary):
        for d in defenses:
            cell = t["leakage"].get(d, {}).get("span-down")
            blocked = t.get("blocked", {}).get(d, {}).get("span-down")
            if cell is None and blocked is None:
                continue
            cell = cell or {}
            rows.append(
                [
                    f"`{name}` (`{t['model']}`)",
                    t.get("weights", "trained"),
                    t.get("knowledge", {}).get("batch_size", "?"),
                    t.get("samples", "?"),
                    f"`{d}` ({recipe(d)})",
                    fmt(cell.get("token_recovery")) if cell else f"blocked: {blocked}",
                    fmt(cell.get("exact_recovery")),
                    fmt(cell.get("presence_f1")),
                    fmt(cell.get("seconds"), 1),
                ]
            )
    header = [
        "task (model)",
        "weights",
        "batch",
        "updates",
        "AEGIS",
        "token recovery",
        "exact",
        "presence F1",
        "s / update",
    ]
    return table(header, rows)


def cost_table(utility: dict[str, Any]) -> str:
    task = utility["tasks"]["sst2-minilm"]["utility"]
    base = task.get("none", {}).get("test_accuracy_mean")
    rows = []
    for d in ("none", *COST):
        u = task.get(d)
        if not u:
            continue
        acc = u["test_accuracy_mean"]
        gap = "—" if d == "none" or base is None else f"{100 * (acc - base):+.1f} pts"
        rows.append([f"`{d}`", f"{acc:.4f} ± {u['test_accuracy_std']:.4f}", gap, len(u["test_accuracy_values"])])
    return table(["defense", "SST-2 dev accuracy (mean ± std)", "vs none", "seeds"], rows)


def render(summaries: dict[str, dict[str, Any]]) -> str:
    attack, utility = summaries["aegis-down"], summaries["minilm-utility"]
    return "\n\n".join(
        [
            "### AEGIS's down-projection channel: `span-down`, no candidate pool",
            NOTES["NOTE"],
            attack_table(attack),
            NOTES["COST"],
            cost_table(utility),
            NOTES["MINILM"],
        ]
    )
