"""Section span-robust: `span-robust` beside `span` under client dropout, from
configs/paper/span_robust.yaml (the exact DAGER span check vs the dropout-robust test)."""

from __future__ import annotations

from typing import Any

from results.notes import notes
from results.tables import fmt, table

NOTES = notes(__name__)

#: each preset's width (veil.models): the span test needs the batch's tokens below it
WIDTH = {"minilm": 384, "gpt-tiny": 128, "transformer4": 96, "hf-gpt2": 256}
#: the issue's token_recovery goal for span-robust, per task (others: reported)
GOALS = {"minilm-b1": 0.8, "minilm-b4": 0.5}
ATTACKS = ("span-robust", "span")
NOTE = NOTES["NOTE"]


def render(summary: dict[str, Any]) -> str:
    raw = {t["name"]: t for t in summary["config"]["tasks"]}
    rows = []
    for name, t in summary["tasks"].items():
        max_len = raw[name]["run"]["data"]["max_len"]
        for attack in ATTACKS:
            m = t["leakage"]["none"][attack]
            goal = "reported"
            if attack == "span-robust" and name in GOALS:
                met = m.get("token_recovery", 0.0) >= GOALS[name]
                goal = f"≥ {GOALS[name]:g} " + ("met" if met else "**not met**")
            rows.append(
                [f"{t['model']} ({WIDTH.get(t['model'], '?')})", t["knowledge"]["batch_size"], max_len]
                + [f"{t['dropout']:g}", attack, fmt(m.get("token_recovery")), fmt(m.get("rouge1"))]
                + [fmt(m.get("presence_f1")), fmt(m.get("exact_recovery"), 2), fmt(m.get("seconds"), 1), goal]
            )
    header = ["model (width)", "batch", "max_len", "client dropout", "attack", "token_recovery", "ROUGE-1"]
    header += ["presence F1", "exact", "s/update", "goal"]
    counts = {name: t["samples"] for name, t in summary["tasks"].items()}
    most = max(set(counts.values()), key=list(counts.values()).count)
    other = ", ".join(f"{name}: {n}" for name, n in counts.items() if n != most)
    b4 = summary["tasks"].get("minilm-b4", {}).get("leakage", {}).get("none", {}).get("span-robust", {})
    notes = NOTE.format(exact_b4=fmt(b4.get("exact_recovery"), 2))
    return (
        f"### Span attack under client dropout (`span-robust`), SST-2, {most} updates per cell"
        + (f" ({other})" if other else "")
        + "\n\n"
        + table(header, rows)
        + "\n\n"
        + notes
    )
