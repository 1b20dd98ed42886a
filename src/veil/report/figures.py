"""Figures for reports: reconstruction grids, privacy-utility scatter (matplotlib, Agg)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def _save(fig: plt.Figure, path: Path) -> Path:
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def image_grid(original: Any, reconstruction: Any, path: Path, title: str = "") -> Path:
    """Originals (top row) above reconstructions (bottom row)."""
    o, r = np.asarray(original), np.asarray(reconstruction)
    n = max(len(o), 1)
    fig, axes = plt.subplots(2, n, figsize=(1.6 * n + 0.6, 3.4), squeeze=False)
    for i in range(n):
        for row, imgs in enumerate((o, r)):
            ax = axes[row][i]
            ax.axis("off")
            if i < len(imgs):
                img = np.transpose(imgs[i], (1, 2, 0))
                ax.imshow(img.squeeze(-1) if img.shape[-1] == 1 else img, cmap="gray", vmin=0, vmax=1)
    axes[0][0].set_title("original", fontsize=8, loc="left")
    axes[1][0].set_title("rebuilt", fontsize=8, loc="left")
    if title:
        fig.suptitle(title, fontsize=9)
    return _save(fig, path)


def privacy_utility(points: list[tuple[str, str, float, float]], ylabel: str, path: Path, title: str) -> Path:
    """x = accuracy, y = worst-case leakage: one point per defense, labelled with the attack that won there."""
    defenses = sorted({d for d, _, _, _ in points})
    colour = {d: f"C{i % 10}" for i, d in enumerate(defenses)}
    fig, ax = plt.subplots(figsize=(5.6, 3.6))
    for d, a, x, y in points:
        ax.scatter([x], [y], color=colour[d])
        ax.annotate(f"{d}\n({a})", (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.margins(x=0.35, y=0.15)  # room for the labels
    ax.set_xlabel("test accuracy (higher: more utility)", fontsize=7)
    ax.set_ylabel(f"{ylabel} (higher: more leakage)", fontsize=7)
    ax.tick_params(labelsize=7)
    ax.set_title(title, fontsize=9)
    return _save(fig, path)
