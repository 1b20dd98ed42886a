"""Section mjp-fig9: MJP Fig. 9 analogue, 2-D PCA of recovered vs original token embeddings with
their cosine similarity, from `veil analyze tokens` on the runs of configs/paper/mjp_fig9_tokens.yaml
(collected as mjp-fig9-tokens: `panels[i]` cosine_2d, cosine_full, token_recovery; the figure)."""

from __future__ import annotations

from typing import Any

from results.notes import notes
from results.tables import fmt, table

NOTES = notes(__name__)

SOURCES = ("mjp-fig9-tokens",)
NOTE = NOTES["NOTE"]
CAVEAT = NOTES["CAVEAT"]


def render(summary: dict[str, Any]) -> str:
    s = summary.get("settings", {})
    rows = [
        [p["label"], p["tokens"], fmt(p["cosine_2d"]), fmt(p["cosine_full"]), fmt(p["token_recovery"])]
        for p in summary["panels"]
    ]
    header = ["model (defense in training and in the attacked step)", "tokens", "cos 2-D", "cos full", "token recovery"]
    note = NOTE.format(
        attack=s.get("attack", "tag"), iterations=s.get("iterations", "?"), samples=s.get("samples", "?")
    )
    base = next((p for p in summary["panels"] if "none" in p["label"]), None)
    if base is not None and base["token_recovery"] < 0.5:
        rec = ", ".join(f"{p['label']} {p['token_recovery']:.2f}" for p in summary["panels"])
        note += (
            f" **Here the attack fails on the undefended model too** (token recovery {rec}): the recovered and "
            "original tokens separate in every panel, so this figure cannot tell MJP's effect from the attack's "
            "failure; the paper's contrast (intermixed without MJP, clustered with it) is not reproduced at this "
            "budget. A longer TAG run, LAMP, or the span attacks (which need no optimisation) are the stronger test."
        )
    fig = summary.get("tasks", {}).get("fig9", {}).get("figure_doc")
    image = f"\n\n![Fig. 9 analogue: recovered vs original token embeddings, 2-D PCA]({fig})" if fig else ""
    return (
        f"### Recovered vs original token embeddings, 2-D PCA (Fig. 9 analogue)\n\n{note}\n\n{table(header, rows)}"
        f"{image}\n\n{CAVEAT}"
    )
