"""PCA of a model's position-embedding table (MJP paper, Fig. 2 / Fig. 7 and Table XII).

`pe_rows` takes the rows that encode input positions (the patch grid for ViTs, without [CLS];
every slot for text), `pca` projects them with a numpy SVD, `explained_variance` gives the
cumulative share of variance kept by the first k components (Table XII), and `plot_pe` draws the
1-D (PC1 against position), 2-D and 3-D projections with position labels.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display: before pyplot loads
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from veil.models.base import VeilModel  # noqa: E402


def pe_rows(model: VeilModel, rows: int | None = None) -> tuple[np.ndarray, list[str]]:
    """(P, D) position embeddings and their labels: "r,c" on the patch grid, "i" for text."""
    table = model.position_table().detach().float().cpu().numpy()
    table = table.reshape(-1, table.shape[-1])
    if model.modality == "image":
        H, W = model.grid_shape
        table = table[1 : 1 + H * W]  # row 0 is [CLS]
        labels = [f"{i // W},{i % W}" for i in range(H * W)]
    else:
        table = table[:rows] if rows else table
        labels = [str(i) for i in range(len(table))]
    return table, labels


def pca(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Projections on all principal components and each component's variance ratio."""
    xc = x - x.mean(0, keepdims=True)
    _, s, vt = np.linalg.svd(xc, full_matrices=False)
    var = s**2
    return xc @ vt.T, var / max(var.sum(), 1e-30)


def explained_variance(ratios: np.ndarray, dims: int = 10) -> dict[int, float]:
    """Cumulative explained variance (%) for projected dimension 1..dims."""
    cum = np.cumsum(ratios)
    return {k: round(float(cum[min(k, len(cum)) - 1]) * 100, 2) for k in range(1, dims + 1)}


def plot_pe(proj: np.ndarray, labels: list[str], out: Path, title: str, label_every: int = 1) -> list[Path]:
    """1-D, 2-D and 3-D scatter plots of the projections, position labels on every point."""
    n = len(labels)
    idx = np.arange(n)
    show = idx % max(label_every, 1) == 0
    paths = []
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.scatter(idx, proj[:, 0], c=idx, cmap="viridis", s=14)
    ax.scatter(idx[:1], proj[:1, 0], c="red", marker="*", s=80)
    for i in idx[show]:
        ax.annotate(labels[i], (i, proj[i, 0]), fontsize=6)
    ax.set(xlabel="position", ylabel="PC1", title=f"{title}: 1-D PCA")
    paths.append(_save(fig, out / "pe_pca_1d.png"))
    fig, ax = plt.subplots(figsize=(5.5, 5))
    ax.scatter(proj[:, 0], proj[:, 1] if proj.shape[1] > 1 else 0 * idx, c=idx, cmap="viridis", s=14)
    for i in idx[show]:
        ax.annotate(labels[i], (proj[i, 0], proj[i, 1] if proj.shape[1] > 1 else 0), fontsize=6)
    ax.set(xlabel="PC1", ylabel="PC2", title=f"{title}: 2-D PCA")
    paths.append(_save(fig, out / "pe_pca_2d.png"))
    fig = plt.figure(figsize=(6, 5.5))
    ax = fig.add_subplot(projection="3d")
    p3 = np.pad(proj[:, :3], ((0, 0), (0, max(0, 3 - proj.shape[1]))))
    ax.scatter(p3[:, 0], p3[:, 1], p3[:, 2], c=idx, cmap="viridis", s=14)
    for i in idx[show]:
        ax.text(p3[i, 0], p3[i, 1], p3[i, 2], labels[i], fontsize=6)
    ax.set(xlabel="PC1", ylabel="PC2", zlabel="PC3", title=f"{title}: 3-D PCA")
    paths.append(_save(fig, out / "pe_pca_3d.png"))
    return paths


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def analyze_model_pe(
    model: VeilModel,
    out: str | Path,
    title: str = "position embeddings",
    dims: int = 10,
    rows: int | None = None,
    plots: bool = True,
) -> dict[str, Any]:
    """Write pe_analysis.json / .md (Table XII analogue) and the PCA plots into `out`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    x, labels = pe_rows(model, rows)
    proj, ratios = pca(x)
    ev = explained_variance(ratios, dims)
    result = {
        "title": title,
        "rows": int(x.shape[0]),
        "dim": int(x.shape[1]),
        "explained_variance_percent": {str(k): v for k, v in ev.items()},
        "component_ratio_percent": [round(float(r) * 100, 3) for r in ratios[:dims]],
    }
    if plots:
        every = 1 if len(labels) <= 80 else max(1, len(labels) // 40)
        result["plots"] = [p.name for p in plot_pe(proj, labels, out, title, every)]
    (out / "pe_analysis.json").write_text(json.dumps(result, indent=2))
    head = "| Projected dimension | " + " | ".join(str(k) for k in ev) + " |"
    sep = "|---" * (len(ev) + 1) + "|"
    row = f"| {title} EV (%) | " + " | ".join(f"{v:.2f}" for v in ev.values()) + " |"
    (out / "pe_analysis.md").write_text("\n".join([head, sep, row]) + "\n")
    return result
