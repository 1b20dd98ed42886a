"""The MJP paper's Fig. 9 figure: one panel per model, the 2-D PCA projections of the original and
the recovered token embeddings, the panel titled with its model and the cosine similarity
(numbers from `veil.analysis.tokens`). Legends sit below the axes, titles are wrapped, so no text
covers a point or leaves the canvas (the rules of `veil.report.figures`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from veil.report.figures import DPI, wrap  # noqa: E402

ORIGINAL, RECOVERED = "#1565c0", "#c62828"


def token_pca_figure(panels: list[dict[str, Any]], path: str | Path, title: str = "") -> Path:
    """Draw `panels` (each: ``label``, ``points`` {original, recovered: (n, 2) lists},
    ``cosine_2d``, ``token_recovery``) side by side into `path` (PNG)."""
    n = max(len(panels), 1)
    fig, axes = plt.subplots(1, n, figsize=(3.6 * n, 4.2), dpi=DPI, layout="constrained", squeeze=False)
    for ax, p in zip(axes[0], panels):
        o = np.asarray(p["points"]["original"], dtype=float).reshape(-1, 2)
        r = np.asarray(p["points"]["recovered"], dtype=float).reshape(-1, 2)
        ax.scatter(o[:, 0], o[:, 1], s=14, c=ORIGINAL, marker="o", alpha=0.75, label="original")
        ax.scatter(r[:, 0], r[:, 1], s=14, c=RECOVERED, marker="x", alpha=0.75, label="recovered")
        lines = [wrap(str(p["label"]), 40), f"cos {p['cosine_2d']:.3f}, token recovery {p['token_recovery']:.2f}"]
        ax.set_title("\n".join(lines), fontsize=9)
        ax.set_xlabel("PC1", fontsize=8)
        ax.set_ylabel("PC2", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, frameon=False)
    if title:
        fig.suptitle(wrap(title, 30 * n), fontsize=10)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path
