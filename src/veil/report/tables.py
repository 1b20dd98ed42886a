"""The report's per-attack tables, one per metric family, so no column is empty: each table takes
the cells (defense x attack) that measured its family's key metric and shows only the columns some
of them filled.

Families: images, the whole image (PSNR, SSIM, MSE, spectrum); images, by region (where a defense
shuffles or masks patches: the patches left in place, the masked set, the patch counts); text, the
tokens rebuilt (with the leakage score the headline's verdict reads: the share of the client's
words the server holds plus the share rebuilt in place, 0-2); text, the words present (bag of words
only); labels. Each row keeps the cell's seconds, so every table reads on its own. Rows run in the
utility table's defense order, then the scenario's attack order.
"""

from __future__ import annotations

from typing import Any

from veil.metrics.leakage import cell_leakage
from veil.report.matrix import attacks_of
from veil.report.numbers import MISSING, metric

SCORE = "score"
#: the text tables' name of the leakage score (and the privacy-utility plot's text axis)
SCORE_TEXT = "score (0-2)"

#: (title, the metric a cell needs to appear, the columns in order)
FAMILIES: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("Images: the whole image", "psnr", ("psnr", "ssim", "mse", "fft2d", "seconds")),
    (
        "Images: by region (patches a defense left in place, the masked set)",
        "psnr_unshuffled",
        ("psnr_unshuffled", "ssim_unshuffled", "psnr_masked_set", "masked_patches", "moved_patches", "seconds"),
    ),
    (
        "Text: tokens rebuilt (score: the share of the client's words the server holds + the share in place, 0-2)",
        "token_recovery",
        (
            SCORE,
            "token_recovery",
            "unshuffled_recovery",
            "exact_recovery",
            "rouge1",
            "rouge2",
            "bag_recall",
            "moved_tokens",
            "seconds",
        ),
    ),
    (
        "Text: words present (bag of words)",
        "presence_f1",
        ("presence_f1", "presence_precision", "presence_recall", "seconds"),
    ),
    ("Labels", "label_accuracy", ("label_accuracy", "seconds")),
)
HEADERS = {
    SCORE: SCORE_TEXT,
    "psnr": "psnr (dB)",
    "psnr_unshuffled": "psnr_unshuffled (dB)",
    "psnr_masked_set": "psnr_masked_set (dB)",
    "seconds": "seconds",
}


def _value(cell: dict[str, Any], key: str) -> Any:
    if key == SCORE:
        cl = cell_leakage(cell)
        return None if cl is None or cl["tier"] == 0 else float(cl["score"])
    return cell.get(key)


def attack_tables(t: dict[str, Any]) -> list[tuple]:
    """("p", title) and ("table", header, rows) per family that has a cell; rows [defense, attack, ...]."""
    defenses = list(t.get("utility", {})) + [d for d in t.get("leakage", {}) if d not in t.get("utility", {})]
    attacks = attacks_of(t)
    cells = [(d, a, t["leakage"][d][a]) for d in defenses for a in attacks if a in t.get("leakage", {}).get(d, {})]
    blocks: list[tuple] = []
    for title, needs, columns in FAMILIES:
        mine = [(d, a, c) for d, a, c in cells if isinstance(c.get(needs), (int, float))]
        if not mine:
            continue
        kept = [k for k in columns if any(_value(c, k) is not None for _, _, c in mine)]
        rows = [[d, a, *(metric(k, _value(c, k)) for k in kept)] for d, a, c in mine]
        blocks += [("p", f"**{title}**"), ("table", ["defense", "attack", *(HEADERS.get(k, k) for k in kept)], rows)]
    return blocks


def empty_share(blocks: list[tuple]) -> float:
    """The share of the tables' value cells that are empty (for the tests)."""
    values = [v for b in blocks if b[0] == "table" for row in b[2] for v in row[2:]]
    return sum(v == MISSING for v in values) / max(len(values), 1)
