"""Figures of a federated run: leakage per round (one panel per attack metric) beside accuracy."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np


def plot_leakage(events: list[dict[str, Any]], path: Path, metrics: tuple[str, ...] = ("psnr", "ssim")) -> Path | None:
    """PNG of test accuracy and, per attack, the mean PSNR / SSIM over audited clients per round."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rounds = [e for e in events if e.get("event") == "round"]
    audits = [e for e in events if e.get("event") == "audit" and "skipped" not in e]
    if not rounds:
        return None
    shown = [m for m in metrics if any(m in e for e in audits)]
    fig, axes = plt.subplots(1, 1 + len(shown), figsize=(4.2 * (1 + len(shown)), 3.2), squeeze=False)
    ax = axes[0, 0]
    ax.plot([e["round"] for e in rounds], [e["test_accuracy"] for e in rounds], marker=".")
    ax.set(xlabel="round", ylabel="test accuracy", title="utility")
    for ax, m in zip(axes[0, 1:], shown):
        per: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
        for e in audits:
            if m in e:
                per[e["attack"]][e["round"]].append(float(e[m]))
        for attack, by_round in sorted(per.items()):
            xs = sorted(by_round)
            ax.plot(xs, [np.mean(by_round[x]) for x in xs], marker="o", label=attack)
        ax.set(xlabel="round", ylabel=m.upper(), title=f"leakage ({m.upper()}, higher = worse)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
