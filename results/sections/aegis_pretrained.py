"""Section aegis-pretrained: AEGIS on pretrained decoders (gpt-tiny pretrained on the
shipped AG News text, fine-tuned on SST-2), validation perplexity with and without AEGIS's
variants, from configs/paper/aegis_pretrained_decoders.yaml."""

from __future__ import annotations

from typing import Any

from results.notes import notes
from results.sections.aegis_recipe import recipe_table
from results.tables import scenario_tasks

NOTES = notes(__name__)

SOURCES = ("aegis-pretrained-decoders",)
NOTE = NOTES["NOTE"]


def render(summary: dict[str, Any]) -> str:
    parts = []
    for _, t, _, defenses in scenario_tasks(summary):
        parts.append(f"**`{t['model']}` (pretrained) on `{t['data']}`**\n\n{recipe_table(t, defenses)}")
    body = "\n\n".join(parts)
    return (
        f"### AEGIS on pretrained decoders (validation perplexity)\n\n{NOTE.format(seeds=summary['seeds'])}\n\n{body}"
    )
