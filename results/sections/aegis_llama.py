"""Section aegis-llama: the attack table of the LLaMA-style decoder with and without AEGIS, from
configs/paper/aegis_llama_attacks.yaml (`summary.tasks[t]`: utility (perplexity), leakage,
blocked, skipped)."""

from __future__ import annotations

from typing import Any

from results.notes import notes
from results.tables import fmt, scenario_tasks, table

NOTES = notes(__name__)

SOURCES = ("aegis-llama-attacks",)
METRICS = ("presence_f1", "presence_recall", "token_recovery", "rouge1")
NOTE = NOTES["NOTE"]
SPAN = NOTES["SPAN"]


def _short(reason: str, width: int = 110) -> str:
    reason = " ".join(str(reason).split())
    return reason if len(reason) <= width else reason[: width - 1] + "…"


def render(summary: dict[str, Any]) -> str:
    parts, meta = [], {"samples": "?", "batch": "?"}
    for _, t, _, defenses in scenario_tasks(summary):
        meta = {"samples": t.get("samples", "?"), "batch": t.get("knowledge", {}).get("batch_size", "?")}
        util = [
            [
                d,
                fmt(t["utility"][d].get("test_perplexity_mean"), 1),
                fmt(100 * t["utility"][d]["test_accuracy_mean"], 2),
            ]
            for d in defenses
            if d in t["utility"]
        ]
        parts.append(table(["defense", "test perplexity", "next-token accuracy (%)"], util))
        rows = []
        for d in defenses:
            for a, m in sorted(t["leakage"].get(d, {}).items()):
                rows.append([d, a, *(fmt(m.get(k)) for k in METRICS), "—"])
            for a, why in sorted(t["blocked"].get(d, {}).items()):
                rows.append([d, a, *("—" for _ in METRICS), _short(why)])
        parts.append(table(["defense", "attack", *METRICS, "refused / blocked (one line)"], rows))
        skipped = t.get("skipped") or {}
        if skipped:
            parts.append(
                "Not run (do not apply to the model): " + "; ".join(f"`{a}`: {_short(w)}" for a, w in skipped.items())
            )
    note = NOTE.format(seeds=summary["seeds"], **meta)
    body = "\n\n".join(parts)
    return f"### AEGIS on the LLaMA-style decoder: the attack table\n\n{note}\n\n{body}\n\n{SPAN}"
