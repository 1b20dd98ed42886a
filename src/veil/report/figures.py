"""Figures for reports: reconstruction grids and the privacy-utility plot (matplotlib, Agg).

Both are drawn to be read at a glance and checked by machine (tests/test_report_figures.py): no
text leaves the canvas, no two texts overlap, and no text covers a plotted point. Hence the rules
here: long labels are wrapped (`wrap`), the privacy-utility plot names defenses and attacks in
legends beside the axes instead of annotations at the points, and images are drawn at a fixed
physical size with nearest-neighbour upsampling, so an 8x8 digit is over 100 pixels wide.
"""

from __future__ import annotations

import math
import re
import textwrap
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402
from matplotlib.ticker import FuncFormatter, MaxNLocator  # noqa: E402

DPI = 100
CELL_IN = 1.25  #: one image of a grid, inches (125 px at DPI: an 8x8 digit upsampled 15x)
GRID_CELL_IN = 1.0  #: one image of the report's per-defense grid (100 px: an 8x8 digit upsampled 12x)
COLUMNS = 6  #: images per band of a grid; more wrap into another band (original row + rebuilt row)
CAP_DB = 100.0  #: PSNR drawn at this height and above: an exact copy (inf included)
MIN_ACC_SPAN = 0.05  #: the accuracy axis spans at least 5 points, never a fraction of one
#: verdict colours, shared with the report's headline (veil.report.headline)
COLOURS = {
    "leaks": "#c62828",
    "partly": "#d97900",
    "holds": "#2e7d32",
    "untested": "#757575",
    "unknown": "#5c6bc0",
    "blocked": "#00695c",
    "not applicable": "#8d8d8d",
    "not run": "#e4e4e4",
}
MARKERS = "os^Dv<>pP*Xh"


def wrap(text: str, width: int) -> str:
    """`text` in lines of at most `width` characters, broken at spaces, then after the commas of a
    long word (`ig(iterations=150,restarts=1) vs mjp(gamma=0.1)` keeps its options whole where it can),
    then anywhere."""
    lines: list[str] = []
    for word in text.split():
        parts = [p for p in re.split(r"(?<=,)", word) if p] if len(word) > width else [word]
        for k, part in enumerate(parts):
            glue = "" if k else " "
            if lines and len(lines[-1]) + len(glue) + len(part) <= width:
                lines[-1] += glue + part
            else:
                lines += textwrap.wrap(part, width, break_long_words=True) or [part]
    return "\n".join(lines)


def _save(fig: plt.Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def _hwc(img: Any) -> np.ndarray:
    """One image (C, H, W) or (H, W) as what imshow takes: (H, W) grey or (H, W, 3), in [0, 1]."""
    a = np.clip(np.nan_to_num(np.asarray(img, dtype=np.float32)), 0.0, 1.0)
    if a.ndim == 3:
        a = np.transpose(a, (1, 2, 0))
        a = a[..., 0] if a.shape[-1] == 1 else a
    return a


def reconstruction_grid(columns: list[tuple[str, Any, Any]], path: Path, title: str = "") -> Path:
    """Several samples side by side: each column one (label, original, reconstruction), the
    original above its reconstruction; bands of `COLUMNS` columns, one under another."""
    cols = columns or [("", np.zeros((1, 8, 8)), np.zeros((1, 8, 8)))]
    n = len(cols)
    per = min(n, COLUMNS)
    bands = math.ceil(n / per)
    lines = max((label.count("\n") + 1 if label else 0) for label, _, _ in cols)
    head_in = 0.16 * lines + 0.08  # room for a column's label above its original
    title = wrap(title, int(12 * (per * CELL_IN + 0.9))) if title else ""
    title_in = 0.22 * (title.count("\n") + 1) + 0.12 if title else 0.1
    left_in, gap_in = 0.75, 0.12
    band_in = head_in + 2 * CELL_IN + gap_in + 0.15
    width = left_in + per * (CELL_IN + gap_in) + 0.1
    height = title_in + bands * band_in
    fig = plt.figure(figsize=(width, height), dpi=DPI)
    if title:
        fig.text(0.5, 1 - 0.1 / height, title, ha="center", va="top", fontsize=9)
    for i, (label, orig, rec) in enumerate(cols):
        band, col = divmod(i, per)
        x = (left_in + col * (CELL_IN + gap_in)) / width
        top = height - title_in - band * band_in - head_in
        for row, img in enumerate((orig, rec)):
            y = (top - (row + 1) * CELL_IN - row * gap_in) / height
            ax = fig.add_axes((x, y, CELL_IN / width, CELL_IN / height))
            ax.imshow(_hwc(img), cmap="gray", vmin=0, vmax=1, interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            if col == 0:
                ax.set_ylabel("original" if row == 0 else "rebuilt", fontsize=8)
            if row == 0 and label:
                ax.set_title(label, fontsize=7, pad=3)
    return _save(fig, path)


def defense_grid(
    columns: list[str],
    originals: list[Any],
    rows: list[tuple[str, list[Any]]],
    path: Path,
    notes: dict[tuple[int, int], str] | None = None,
) -> Path:
    """What each attack rebuilt, one row per defense: `columns` name the attacks (and samples),
    the first row holds their originals, each of `rows` = (defense, one image or None per column)
    what the attack rebuilt against that defense; an empty slot shows its note (`notes[(row,
    column)]`: blocked, not applicable) or a dash. Images at `CELL_IN` inches, nearest neighbour."""
    notes = notes or {}
    labels = [wrap(c, 24) for c in columns]
    names = [wrap(d, 26) for d, _ in rows]
    head_in = 0.15 * max((lab.count("\n") + 1 for lab in labels), default=1) + 0.08
    left_in = 0.2 + 0.07 * max(max((len(line) for n in names for line in n.split("\n")), default=8), 8)
    cell_in, gap_in = GRID_CELL_IN, 0.1
    width = left_in + len(columns) * (cell_in + gap_in) + 0.1
    height = head_in + (len(rows) + 1) * (cell_in + gap_in) + 0.1
    fig = plt.figure(figsize=(width, height), dpi=DPI)
    for r, (_, images) in enumerate([("original", originals), *rows]):
        top = height - head_in - r * (cell_in + gap_in)
        y = (top - cell_in) / height
        fig.text(
            0.1 / width, (top - cell_in / 2) / height, "original" if r == 0 else names[r - 1], fontsize=8, va="center"
        )
        for c, img in enumerate(images):
            x = (left_in + c * (cell_in + gap_in)) / width
            ax = fig.add_axes((x, y, cell_in / width, cell_in / height))
            ax.set_xticks([])
            ax.set_yticks([])
            if img is None:
                ax.set_facecolor("#f3f3f3")
                ax.text(
                    0.5, 0.5, wrap(notes.get((r - 1, c), "—"), 12), ha="center", va="center", fontsize=7, color="#555"
                )
            else:
                ax.imshow(_hwc(img), cmap="gray", vmin=0, vmax=1, interpolation="nearest")
            if r == 0:
                ax.set_title(labels[c], fontsize=7, pad=3)
    return _save(fig, path)


def image_grid(original: Any, reconstruction: Any, path: Path, title: str = "") -> Path:
    """Originals (top row) above reconstructions (bottom row), one column per image."""
    o, r = np.asarray(original), np.asarray(reconstruction)
    return reconstruction_grid([(f"#{i}", o[i], r[i]) for i in range(min(len(o), len(r)))], path, title)


def _accuracy_limits(xs: list[float]) -> tuple[float, float]:
    lo, hi = min(xs), max(xs)
    span = max(hi - lo, MIN_ACC_SPAN)
    mid = (lo + hi) / 2
    lo, hi = mid - 0.6 * span, mid + 0.6 * span
    if lo < 0:
        lo, hi = 0.0, hi - lo
    if hi > 1:
        lo, hi = max(0.0, lo - (hi - 1)), 1.0
    return lo, hi


MARKER_SIZE = 90.0  #: scatter size (points^2) of the privacy-utility plot
MARKER_PX = 14.0  #: the distance (pixels) two of its markers keep apart


def side_by_side(ax: Any, xy: list[tuple[float, float]], apart: float) -> list[float]:
    """The x (data units) to draw each point at so no two markers closer than `apart` pixels hide
    each other: a point that would land on one already placed moves sideways, alternately right
    and left, by whole marker widths; y never moves (it is the leakage)."""
    to_px = ax.transData.transform
    placed: list[tuple[float, float]] = []
    out = []
    for x, y in xy:
        px, py = to_px((x, y))
        for k in range(64):
            shift = apart * ((k + 1) // 2) * (1 if k % 2 else -1)
            if all((px + shift - qx) ** 2 + (py - qy) ** 2 >= apart**2 for qx, qy in placed):
                break
        placed.append((px + shift, py))
        out.append(float(ax.transData.inverted().transform((px + shift, py))[0]))
    return out


def privacy_utility(
    points: list[tuple[str, str, float, float, bool]],
    path: Path,
    title: str,
    image: bool,
    bands: tuple[float, float],
) -> Path:
    """One task's privacy-utility plot: every (defense, attack, accuracy, leakage, is_worst_case).

    x = test accuracy of the defense, y = what the attack rebuilt (images: PSNR in dB of the best
    region, drawn at `CAP_DB` from there up; text: the leakage score, words + words in place, 0-2). Colour names the
    defense, the marker the attack (legends beside the axes, labels wrapped); the worst case per
    defense is filled, the other attacks hollow. Points that would hide each other (equal accuracy
    and leakage) are drawn side by side (`side_by_side`), each tied to its true accuracy by a thin
    line. The figure fits a narrow window (740 px wide). `bands` = (partly, leaks) thresholds,
    shaded in the headline's verdict colours."""
    defenses = list(dict.fromkeys(d for d, *_ in points))
    attacks = list(dict.fromkeys(a for _, a, *_ in points))
    colour = {d: f"C{i % 10}" for i, d in enumerate(defenses)}
    marker = {a: MARKERS[i % len(MARKERS)] for i, a in enumerate(attacks)}
    fig, ax = plt.subplots(figsize=(7.4, 4.4), dpi=DPI, layout="constrained")
    ys = [min(y, CAP_DB) if image else y for *_, y, _ in points]
    top = (max(max(ys, default=0.0), bands[1] + 5.0) + 8.0) if image else 2.1
    lo_y = -0.03 * top  # a point at 0 shows whole
    ax.axhspan(lo_y, bands[0], color=COLOURS["holds"], alpha=0.07, lw=0)
    ax.axhspan(bands[0], bands[1], color=COLOURS["partly"], alpha=0.09, lw=0)
    ax.axhspan(bands[1], top, color=COLOURS["leaks"], alpha=0.07, lw=0)
    ax.set_xlim(*_accuracy_limits([x for _, _, x, _, _ in points] or [0.5]))
    ax.set_ylim(lo_y, top)
    ax.xaxis.set_major_locator(MaxNLocator(6))
    ax.yaxis.set_major_locator(MaxNLocator(6))
    if image and any(y >= CAP_DB for *_, y, _ in points):
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: "≥100" if v >= CAP_DB else f"{v:g}"))
        ax.set_yticks([t for t in ax.get_yticks() if 0 <= t < CAP_DB - 10] + [CAP_DB])
    ax.set_xlabel("test accuracy of the defended model (right: more utility)", fontsize=8)
    ax.set_ylabel(
        "PSNR of the rebuilt image, dB\n(up: more leakage; ≥100 = exact copy)"
        if image
        else "score: words + words in place, 0-2\n(the text tables' score column; up: more leakage)",
        fontsize=8,
    )
    ax.tick_params(labelsize=8)
    ax.grid(alpha=0.25)
    ax.set_title(wrap(title, 70), fontsize=9)
    blank = Line2D([], [], ls="", marker="")
    handles = [blank] + [Line2D([], [], ls="", marker="o", color=colour[d]) for d in defenses]
    labels = ["defense"] + [wrap(d, 26) for d in defenses]
    handles += [blank] + [Line2D([], [], ls="", marker=marker[a], color="#444", mfc="none") for a in attacks]
    labels += ["attack (filled: worst case)"] + [wrap(a, 26) for a in attacks]
    handles += [blank] + [Patch(color=COLOURS[v], alpha=0.3) for v in ("leaks", "partly", "holds")]
    labels += ["verdict band", "leaks", "partly", "holds"]
    fig.legend(handles, labels, loc="outside right upper", fontsize=7, ncols=1 if len(labels) <= 20 else 2)
    fig.draw_without_rendering()  # the layout first: markers are kept apart in the final pixels
    ax.set_autoscale_on(False)
    xs = side_by_side(ax, [(x, y) for (_, _, x, _, _), y in zip(points, ys)], MARKER_PX)
    for (d, a, x, _, worst), x_drawn, y_drawn in zip(points, xs, ys):
        c = colour[d]
        if x_drawn != x:  # moved aside: a thin line back to its true accuracy
            ax.plot([x, x_drawn], [y_drawn, y_drawn], color=c, lw=0.8, alpha=0.6, zorder=1)
        ax.scatter(
            [x_drawn],
            [y_drawn],
            s=MARKER_SIZE,
            marker=marker[a],
            facecolors=c if worst else "none",
            edgecolors=c,
            linewidths=1.6,
            zorder=3 if worst else 2,
        )
    return _save(fig, path)
