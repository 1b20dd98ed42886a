"""Section aegis-recipe: which part of AEGIS costs a causal LM its perplexity, on a validation split
(configs/paper/aegis_decoder_recipe.yaml: llama-tiny from random weights, `sst2-val`). The table
function is shared with the pretrained-decoder section (`aegis_pretrained`)."""

from __future__ import annotations

from typing import Any

from results.notes import labelled, notes
from results.tables import fmt, scenario_tasks, table

NOTES = notes(__name__)

SOURCES = ("aegis-decoder-recipe",)
ROLE = labelled(NOTES["ROLE"])  # what each defense label of the table is
NOTE = NOTES["NOTE"]


WHY = NOTES["WHY"]


def recipe_table(t: dict[str, Any], defenses: list[str]) -> str:
    base = t["utility"].get("none", {}).get("test_perplexity_mean")
    rows = []
    for d in defenses:
        u = t["utility"].get(d)
        if u is None:
            continue
        ppl = u.get("test_perplexity_mean")
        gap = None if base in (None, 0) or ppl is None else 100 * (ppl / base - 1)
        leak = t["leakage"].get(d, {})
        rows.append(
            [
                d,
                ROLE.get(d, ""),
                fmt(ppl, 1),
                "—" if d == "none" or gap is None else f"{gap:+.1f} %",
                "—" if d == "none" or gap is None else ("yes" if gap <= 10.0 else "**no**"),
                fmt(leak.get("presence", {}).get("presence_f1")),
                fmt(leak.get("presence-adaptive", {}).get("presence_f1")),
            ]
        )
    header = [
        "defense",
        "what it does",
        "validation perplexity",
        "vs undefended",
        "within 10 %",
        "presence F1",
        "presence-adaptive F1",
    ]
    return table(header, rows)


def render(summary: dict[str, Any]) -> str:
    parts, meta = [], {"batch": "?", "samples": "?"}
    for _, t, _, defenses in scenario_tasks(summary):
        meta = {"batch": t.get("knowledge", {}).get("batch_size", "?"), "samples": t.get("samples", "?")}
        parts.append(f"**`{t['model']}` on `{t['data']}`**\n\n{recipe_table(t, defenses)}")
    note = NOTE.format(seeds=summary["seeds"], **meta)
    body = "\n\n".join(parts)
    title = "### Which part of AEGIS costs a decoder its perplexity (validation split)"
    return f"{title}\n\n{note}\n\n{WHY}\n\n{body}"
