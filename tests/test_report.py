"""The report reads at a glance: a headline first, and nothing clipped or overlapping, checked on
every figure the report draws (matplotlib's own text extents) and on report.html in a real
headless browser (chromium through selenium; skipped with its reason where chromium is absent).

Both build the report from a small summary written here (the quickstart's defenses and attacks
with their long labels, an inf PSNR, equal accuracies, a blocked attack), never from training."""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np
import pytest
from matplotlib.collections import PathCollection
from matplotlib.figure import Figure
from matplotlib.text import Text

from veil.metrics.leakage import worst_case
from veil.report.render import write_reports

IMAGE_ATTACKS = ("april", "april-mjp", "ig(iterations=150,restarts=1)", "head-embedding", "labels")


def _digits(n: int) -> np.ndarray:
    from sklearn.datasets import load_digits

    return (load_digits().images[:n] / 16.0).astype(np.float32)[:, None]  # (n, 1, 8, 8) in [0, 1]


def _task(model: str, data: str, util: dict[str, float], leak: dict, blocked: dict) -> dict[str, Any]:
    knows = {a: f"{a}: the update and the weights; not the defense (naive)" for m in leak.values() for a in m}
    return {
        "model": model,
        "data": data,
        "protocol": "single-step",
        "dropout": 0.0,
        "knowledge": {"batch_size": 1},
        "samples": 2,
        "utility": {
            d: {"test_accuracy_mean": a, "test_accuracy_std": 0.0, "test_accuracy_values": [a]} for d, a in util.items()
        },
        "leakage": leak,
        "skipped": {},
        "blocked": blocked,
        "overhead": dict(zip(util, (1.0, 1.1503, 0.9921))),  # the ratios of three repeated runs
        "overhead_spread": dict(zip(util, ([1.0, 1.0], [1.08, 1.26], [0.95, 1.04]))),
        "step_seconds": dict.fromkeys(util, 0.01),
        "attacker_knows": knows,
        "worst_case": {d: worst_case(leak.get(d, {}), knows, blocked.get(d)) for d in util},
    }


def summary_and_examples() -> tuple[dict[str, Any], dict[str, list[dict[str, Any]]]]:
    """Two tasks like the quickstart's: digits (none / MJP / DP-SGD at equal accuracies) and SST-2."""
    m = {"psnr": 10.2, "ssim": 0.53, "psnr_unshuffled": 12.1, "ssim_unshuffled": 0.77, "masked_patches": 2.0}
    digits_leak = {
        "none": {
            "april": {"psnr": 119.06, "ssim": 1.0},
            "april-mjp": {"psnr": 111.6, "ssim": 1.0},
            "ig(iterations=150,restarts=1)": {"psnr": 7.23, "ssim": 0.23, "label_accuracy": 1.0},
            "head-embedding": {"psnr": math.inf, "ssim": 1.0},
            "labels": {"label_accuracy": 1.0},
        },
        "mjp(gamma=0.1)": {
            "april": m,
            "april-mjp": {**m, "psnr": 66.4, "psnr_unshuffled": 66.3},
            "ig(iterations=150,restarts=1)": {"psnr": 6.98, "ssim": 0.09, "label_accuracy": 1.0},
            "head-embedding": {"psnr": math.inf, "ssim": 1.0},
            "labels": {"label_accuracy": 1.0},
        },
        "dpsgd(target_epsilon=3.0,clip=1.0)": {
            "april": {"psnr": 7.9, "ssim": 0.1},
            "ig(iterations=150,restarts=1)": {"psnr": 7.0, "ssim": 0.08},
            "labels": {"label_accuracy": 0.5},
        },
    }
    digits = _task(
        "vit-digits",
        "digits",
        {"none": 0.9276, "mjp(gamma=0.1)": 0.9276, "dpsgd(target_epsilon=3.0,clip=1.0)": 0.9271},
        digits_leak,
        {},
    )
    digits["knowledge"] = {"labels": False, "batch_size": 1}
    digits["skipped"] = {"span-robust": "applies to a client that trains with dropout; this one trains without"}
    digits["attacker_knows"]["span-robust"] = "naive"
    tokens = ("unshuffled_recovery", "exact_recovery", "rouge2", "bag_recall")  # the real table's width
    text_leak = {
        "none": {
            "presence": {"presence_f1": 1.0},
            "span": {"token_recovery": 1.0, "rouge1": 1.0, "presence_f1": 0.97, "moved_tokens": 0.0}
            | dict.fromkeys(tokens, 1.0),
            "tag(iterations=100)": {"token_recovery": 0.1, "rouge1": 0.3, "moved_tokens": 0.0}
            | dict.fromkeys(tokens, 0.1),
        },
        "mjp(gamma=0.5,window=8)": {
            "presence": {"presence_f1": 0.98},
            "span-mjp": {"token_recovery": 0.7, "rouge1": 0.96, "presence_f1": 0.98, "moved_tokens": 7.5}
            | dict.fromkeys(tokens, 0.7),
            "tag(iterations=100)": {"token_recovery": 0.0, "rouge1": 0.2, "moved_tokens": 7.5}
            | dict.fromkeys(tokens, 0.0),
        },
        "aegis": {
            "presence-adaptive": {"presence_f1": 0.35},
            "tag(iterations=100)": {"token_recovery": 0.0, "rouge1": 0.01, "moved_tokens": 0.0}
            | dict.fromkeys(tokens, 0.0),
        },
    }
    blocked = {"aegis": {"span": "the observation has no gradient for blocks.0.attn.qkv.weight (frozen)"}}
    text = _task(
        "transformer4", "sst2", {"none": 0.68, "mjp(gamma=0.5,window=8)": 0.66, "aegis": 0.55}, text_leak, blocked
    )
    summary = {
        "scenario": "report-check",
        "seeds": [0],
        "tasks": {"digits-vit": digits, "sst2-text": text},
        "versions": {"torch": "2.13.0", "platform": "Linux-x86_64"},
        "config": {"name": "report-check", "tasks": [{"name": "digits-vit", "attacks": list(IMAGE_ATTACKS)}]},
    }
    orig = _digits(4)
    rng = np.random.default_rng(0)
    records = []
    for d, attacks in digits_leak.items():
        for a in attacks:
            if a != "labels":
                n = 2 if a == "april-mjp" else 1  # a cell with a batch of two
                rec = np.clip(orig[:n] + rng.normal(0, 0.3, orig[:n].shape), 0, 1)
                records.append({"defense": d, "attack": a, "example": {"original": orig[:n], "reconstruction": rec}})
    records.sort(key=lambda r: (r["defense"], r["attack"]))  # as veil.experiments.cells.examples lists them
    tokens = {"references": [["the", "film", "works"]], "reconstructions": [["the", "film", "fails"]]}
    text_records = [  # as veil.experiments.cells.examples lists them: by folder name
        {"defense": d, "attack": a, "example": tokens}
        for d, a in (("aegis", "tag(iterations=100)"), ("mjp(gamma=0.5,window=8)", "span-mjp"), ("none", "span"))
    ]
    return summary, {"digits-vit": records, "sst2-text": text_records}


def text_problems(fig: Figure, drawn: list[Text]) -> list[str]:
    """Texts outside the canvas, pairs of overlapping texts, texts over a plotted point."""
    renderer = fig.canvas.get_renderer()
    canvas = fig.bbox
    boxes = [(t.get_text().replace("\n", " ")[:40], t.get_window_extent(renderer)) for t in drawn]
    problems = [
        f"outside the canvas: {s!r}"
        for s, b in boxes
        if b.x0 < canvas.x0 - 0.5 or b.y0 < canvas.y0 - 0.5 or b.x1 > canvas.x1 + 0.5 or b.y1 > canvas.y1 + 0.5
    ]
    for i, (s, b) in enumerate(boxes):
        for s2, b2 in boxes[i + 1 :]:
            if min(b.x1, b2.x1) - max(b.x0, b2.x0) > 1 and min(b.y1, b2.y1) - max(b.y0, b2.y0) > 1:
                problems.append(f"overlap: {s!r} and {s2!r}")
    for ax in fig.axes:
        for c in ax.collections:
            if not isinstance(c, PathCollection) or not len(c.get_offsets()):
                continue
            xy = c.get_offset_transform().transform(c.get_offsets())
            r = np.sqrt(np.resize(c.get_sizes(), len(xy))) / 2 * fig.dpi / 72
            for (x, y), rad in zip(xy, r):
                hit = [s for s, b in boxes if b.x0 < x + rad and x - rad < b.x1 and b.y0 < y + rad and y - rad < b.y1]
                problems += [f"text over a point: {s!r}" for s in hit]
    return problems


def test_every_figure_keeps_its_texts_inside_and_apart(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every figure the report draws, and the grid of `veil attack`: no text clipped by the canvas,
    no two texts overlapping, no text on a point; images drawn at >= 96 px, originals above."""
    import matplotlib.pyplot as plt

    from veil.report.figures import image_grid

    saved: list[tuple[Figure, Path]] = []
    drawn: dict[int, list[Text]] = {}
    savefig, text_draw = Figure.savefig, Text.draw

    def keep(fig: Figure, path: Any, *a: Any, **k: Any) -> None:
        saved.append((fig, Path(path)))
        savefig(fig, path, *a, **k)

    def record(self: Text, renderer: Any) -> None:
        if self.get_visible() and self.get_text() and self.figure is not None:
            drawn.setdefault(id(self.figure.get_figure(root=True)), []).append(self)
        text_draw(self, renderer)

    monkeypatch.setattr(Figure, "savefig", keep)
    monkeypatch.setattr(Text, "draw", record)
    monkeypatch.setattr(plt, "close", lambda *a, **k: None)  # keep the figures to inspect them
    summary, examples = summary_and_examples()
    write_reports(summary, tmp_path, examples)
    digits = _digits(16)
    image_grid(digits, digits[::-1], tmp_path / "attack.png", "ig(iterations=150,restarts=1) vs mjp(gamma=0.1)")
    try:
        names = sorted(p.name for _, p in saved)
        assert any("privacy_utility" in n for n in names) and any("digits" in n for n in names), names
        problems = []
        for fig, path in saved:
            drawn.pop(id(fig), None)
            fig.canvas.draw()
            texts = drawn.get(id(fig), [])
            assert len(texts) >= 3, f"{path.name}: only {len(texts)} texts drawn"  # the check has something to check
            problems += [f"{path.name}: {p}" for p in text_problems(fig, texts)]
            for ax in fig.axes:
                for im in ax.get_images():
                    shown = ax.get_window_extent()
                    h, w = im.get_array().shape[:2]
                    if h <= 32 and min(shown.width, shown.height) < 96:  # small images: upsampled to be read
                        problems.append(
                            f"{path.name}: a {h}x{w} image drawn at {shown.width:.0f}x{shown.height:.0f} px"
                        )
            if "privacy_utility" in path.name:
                lo, hi = fig.axes[0].get_xlim()
                if hi - lo < 0.05:
                    problems.append(f"{path.name}: the accuracy axis spans {hi - lo:.4f}, a fraction of a point")
        assert not problems, "\n".join(problems)
    finally:
        plt.close("all")
        matplotlib.rcdefaults()


def test_the_report_opens_with_the_headline(tmp_path: Path) -> None:
    summary, examples = summary_and_examples()
    write_reports(summary, tmp_path, examples)
    md = (tmp_path / "report.md").read_text()
    glance = md.index("## At a glance")
    assert glance < md.index("## Task `digits-vit`")
    lines = md[glance : md.index("## Task")].splitlines()
    mine = [s for s in lines if s.startswith("- ")]
    assert len(mine) == 6  # one line per task x defense
    assert "- **LEAKS** `none` — accuracy 0.928 (the reference); worst case `april`: psnr 119.1 dB (whole image)" in md
    assert (
        "- **LEAKS** `mjp(gamma=0.1)` — accuracy 0.928 (±0.0 pts vs none); worst case `head-embedding`: psnr inf dB"
        in md
    )
    assert (
        "- **HOLDS** `dpsgd(target_epsilon=3.0,clip=1.0)` — accuracy 0.927 (±0.0 pts vs none); worst case `april`" in md
    )
    assert "- **PARTLY** `aegis` — accuracy 0.550 (-13.0 pts vs none); worst case `presence-adaptive`" in md
    assert "holds against the attacks run; a stronger or adaptive attacker may still get through" in md
    assert "protected" not in md[glance:]
    html = (tmp_path / "report.html").read_text()
    assert html.index("At a glance") < html.index("<h2>Task <code><span class='nw'>digits-vit")
    assert html.count("<span class='verdict leaks'>") == 4 and "<span class='verdict holds'>" in html


# --- the page in a real browser ---------------------------------------------------------------

CHECK = """
const out = [];
const root = document.documentElement;
if (root.scrollWidth > root.clientWidth + 1) out.push(`page wider than the window: ${root.scrollWidth} > ${root.clientWidth}`);
const name = (e) => `${e.tagName.toLowerCase()} '${(e.textContent || e.alt || '').trim().slice(0, 40)}'`;
for (const e of document.body.querySelectorAll('*')) {
  const st = getComputedStyle(e);
  if (st.display === 'inline' || e.clientWidth === 0) continue;
  if (e.scrollWidth > e.clientWidth + 1) out.push(`clipped or overflowing: ${name(e)} (${e.scrollWidth} > ${e.clientWidth})`);
}
const boxes = [...document.body.querySelectorAll('h1,h2,h3,p,th,td,li,figcaption,img,pre,span.verdict')];
const rects = boxes.map((e) => e.getBoundingClientRect());
for (let i = 0; i < boxes.length; i++) for (let j = i + 1; j < boxes.length; j++) {
  const a = rects[i], b = rects[j];
  if (boxes[i].contains(boxes[j]) || boxes[j].contains(boxes[i])) continue;
  const w = Math.min(a.right, b.right) - Math.max(a.left, b.left), h = Math.min(a.bottom, b.bottom) - Math.max(a.top, b.top);
  if (w > 1.5 && h > 1.5) out.push(`overlap: ${name(boxes[i])} and ${name(boxes[j])}`);
}
for (const im of document.images) {
  if (!im.complete || im.naturalWidth === 0) out.push(`image not loaded: ${name(im)}`);
  else if (im.clientWidth < im.naturalWidth || im.clientHeight < im.naturalHeight)
    out.push(`image shown below its size: ${im.clientWidth}x${im.clientHeight} < ${im.naturalWidth}x${im.naturalHeight}`);
}
return out;
"""

#: a clipped cell, two overlapping headings and a shrunk image, to show the check can fail
BROKEN = """
const d = document.createElement('div');
d.innerHTML = "<table><tr><td style='width:20px;max-width:20px;white-space:nowrap;overflow:hidden'>aVeryLongUnbrokenWord</td></tr></table>"
  + "<h3 style='position:relative'>first</h3><h3 style='position:relative;top:-30px'>second</h3>"
  + "<img style='width:10px' src='" + document.images[0].src + "'>";
document.body.prepend(d);
"""


def _browser() -> Any:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    driver = shutil.which("chromedriver")
    if not chromium or not driver:
        pytest.skip("no chromium / chromedriver on PATH (apt-get install chromium chromium-driver)")
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install -e '.[dev]')")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--force-device-scale-factor=1",
    ):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(driver), options=options)


def test_report_html_has_no_clipped_or_overlapping_text_in_a_browser(tmp_path: Path) -> None:
    summary, examples = summary_and_examples()
    write_reports(summary, tmp_path, examples)
    browser = _browser()
    try:
        for width in (1280, 1024):  # a laptop's window, and a narrower one
            browser.set_window_size(width, 900)
            browser.get((tmp_path / "report.html").as_uri())
            browser.execute_script("return document.fonts.ready")
            problems = browser.execute_script(CHECK)
            assert not problems, f"at {width} px:\n" + "\n".join(problems)
            assert browser.execute_script("return document.querySelector('h2').textContent") == "At a glance"
            assert len(browser.execute_script("return document.images")) == 3
        browser.execute_script(BROKEN)
        caught = "\n".join(browser.execute_script(CHECK))
        assert "clipped or overflowing: td 'aVeryLongUnbrokenWord'" in caught
        assert "overlap: h3 'first' and h3 'second'" in caught and "image shown below its size: 10x" in caught
    finally:
        browser.quit()


# --- the report at a glance: the defects a reader met, one assertion each --------------------


def _figures(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Figure]:
    """The report's figures by file name, kept open (drawn) to be inspected."""
    import matplotlib.pyplot as plt

    saved: dict[str, Figure] = {}
    savefig = Figure.savefig

    def keep(fig: Figure, path: Any, *a: Any, **k: Any) -> None:
        saved[Path(path).name] = fig
        savefig(fig, path, *a, **k)

    monkeypatch.setattr(Figure, "savefig", keep)
    monkeypatch.setattr(plt, "close", lambda *a, **k: None)
    summary, examples = summary_and_examples()
    write_reports(summary, tmp_path, examples)
    for fig in saved.values():
        fig.canvas.draw()
    return saved


def _markers(fig: Figure) -> list[tuple[float, float, float]]:
    """(x, y, radius) in pixels of every scatter marker of a figure's axes."""
    out = []
    for ax in fig.axes:
        for c in ax.collections:
            if isinstance(c, PathCollection) and len(c.get_offsets()):
                xy = c.get_offset_transform().transform(c.get_offsets())
                r = np.sqrt(np.resize(c.get_sizes(), len(xy))) / 2 * fig.dpi / 72
                out += [(float(x), float(y), float(rad)) for (x, y), rad in zip(xy, r)]
    return out


def test_plot_markers_never_hide_each_other_and_the_text_axis_is_a_table_column(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The digits plot's undefended markers at >= 100 dB (april, april-mjp, head-embedding at one
    accuracy) and the SST-2 plot's attacks at one score were drawn on one spot; the SST-2 axis
    named a quantity no table showed."""
    import matplotlib.pyplot as plt

    try:
        figs = _figures(tmp_path, monkeypatch)
        plots = {n: f for n, f in figs.items() if "privacy_utility" in n}
        assert len(plots) == 2, sorted(figs)
        for name, fig in plots.items():
            marks = _markers(fig)
            assert len(marks) >= 6, name
            hidden = [
                (a, b)
                for i, a in enumerate(marks)
                for b in marks[i + 1 :]
                if math.hypot(a[0] - b[0], a[1] - b[1]) < 0.9 * (a[2] + b[2])
            ]
            assert not hidden, f"{name}: {len(hidden)} pairs of markers on top of each other"
        text_axis = plots["sst2-text_privacy_utility.png"].axes[0].get_ylabel()
        md = (tmp_path / "report.md").read_text()
        header = md[md.index("**Text: tokens rebuilt") :].split("\n")[2]  # the text table's header row
        columns = [c.strip() for c in header.strip("|").split("|")]
        assert any(c.split(" (")[0] in text_axis for c in columns[2:]), (text_axis, columns)
    finally:
        plt.close("all")


def test_reconstructions_are_one_row_per_defense_in_table_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The grid wrapped at 6 columns and split the undefended model across bands; the text examples
    ran aegis -> mjp -> none, the reverse of the tables."""
    import matplotlib.pyplot as plt

    try:
        grid = _figures(tmp_path, monkeypatch)["digits-vit_reconstructions.png"]
        renderer = grid.canvas.get_renderer()
        rows = {t.get_text(): t.get_window_extent(renderer).y0 for t in grid.texts}
        order = ["original", "none", "mjp(gamma=0.1)", "dpsgd(target_epsilon=3.0,clip=1.0)"]
        labels = {k.replace("\n", ""): v for k, v in rows.items()}
        assert all(d in labels for d in order), sorted(labels)
        heights = [labels[d] for d in order]
        assert heights == sorted(heights, reverse=True), "rows run top to bottom in the tables' order"
        titles = [ax.get_title() for ax in grid.axes if ax.get_title()]
        for text in [*rows, *titles]:  # a long name breaks after a comma, never inside a word
            assert all(line.endswith(",") for line in text.split("\n")[:-1]), repr(text)
        images = [ax for ax in grid.axes if ax.get_images()]
        row_of = {round(ax.get_position().y0, 3) for ax in images}
        assert len(row_of) == len(order), "one row of images per defense, and one of originals"
    finally:
        plt.close("all")
    md = (tmp_path / "report.md").read_text()
    at = [md.index(f"against defense {d}**") for d in ("none", "mjp(gamma=0.5,window=8)", "aegis")]
    assert at == sorted(at), "the text reconstructions follow the tables: none, mjp, aegis"


def _columns(md: str) -> list[tuple[str, str]]:
    """(column header, cell) of every cell of every Markdown table."""
    out, header = [], None
    for line in md.splitlines():
        if not line.startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if header is None:
            header = cells
        elif not line.startswith("|---"):
            out += list(zip(header, cells))
    return out


def test_numbers_and_settings_read_as_the_evidence_allows(tmp_path: Path) -> None:
    """Knowledge and seeds in words; no ± for one seed; counts as integers; no inf in a PSNR
    column; step-time ratios to two digits; the per-attack tables without empty columns."""
    from veil.report.markup import to_markdown
    from veil.report.render import summary_blocks

    summary, examples = summary_and_examples()
    write_reports(summary, tmp_path, examples)
    md = (tmp_path / "report.md").read_text()
    assert '{"labels"' not in md and "Seeds: [" not in md
    assert "The attacker knows the batch size (1), not the labels." in md
    assert "The attacker knows the batch size (1)." in md  # sst2: labels not given in its knowledge
    assert "One seed (0)" in md
    assert "± 0.0000" not in md and "±" not in md.split("### Utility and cost")[1].split("###")[0]
    counts = [v for col, v in _columns(md) if col.startswith("masked_patches")]
    assert counts and all(v == "2" for v in counts), counts  # a count of patches, not 2.000
    assert "masked_patches 2.000" not in md
    psnr = [v for col, v in _columns(md) if col.startswith("psnr") and "exact" not in col]
    assert psnr and "inf" not in psnr, psnr
    assert "exact (∞)" in md
    assert "1.150" not in md and "0.992" not in md and "| 1.2× (1.1-1.3) |" in md and "| 0.99× (0.95-1.0) |" in md
    blocks = summary_blocks(summary, tmp_path, examples)
    starts = [i for i, b in enumerate(blocks) if b[0] == "h3" and b[1].startswith("Every attack")]
    assert len(starts) == 2
    per_attack = []
    for start in starts:
        end = next(i for i, b in enumerate(blocks) if i > start and b[0] in ("h2", "h3"))
        per_attack += [b for b in blocks[start:end] if b[0] == "table"]
    assert len(per_attack) >= 5  # split by metric family (images, regions, labels; text, words)
    values = [v for b in per_attack for row in b[2] for v in row[2:]]
    assert values.count("—") / len(values) < 0.1, to_markdown(per_attack, tmp_path)
    for b in per_attack:
        for j in range(2, len(b[1])):
            assert any(row[j] != "—" for row in b[2]), f"column {b[1][j]} is empty"


def test_the_matrix_names_each_cell_verdict(tmp_path: Path) -> None:
    """One defense x attack matrix per task, before any task: a cell per attack and defense with its
    verdict and figure, the accuracy per defense in it."""
    summary, examples = summary_and_examples()
    write_reports(summary, tmp_path, examples)
    md = (tmp_path / "report.md").read_text()
    top = md[: md.index("## Task")]
    assert "| attack | `none` | `mjp(gamma=0.1)` | `dpsgd(target_epsilon=3.0,clip=1.0)` |" in top
    assert "| *test accuracy (vs none)* | 0.928 | 0.928 (±0.0 pts) | 0.927 (±0.0 pts) |" in top
    assert "| *test accuracy (vs none)* | 0.680 | 0.660 (-2.0 pts) | 0.550 (-13.0 pts) |" in top
    assert "| `april` | **LEAKS** 119.1 dB | **PARTLY** 12.1 dB | **HOLDS** 7.9 dB |" in top
    assert "| `head-embedding` | **LEAKS** exact (∞) | **LEAKS** exact (∞) | **NOT RUN** |" in top
    assert "| `span-robust` | **NOT APPLICABLE** | **NOT APPLICABLE** | **NOT APPLICABLE** |" in top
    assert "| `span` | **LEAKS** 2.00 | **NOT RUN** | **BLOCKED** |" in top
    assert "| `tag(iterations=100)` | **PARTLY** 0.40 | **HOLDS** 0.20 | **HOLDS** 0.01 |" in top
    # ig failed on the undefended model too: its failure against a defense is no evidence
    assert "| `ig(iterations=150,restarts=1)` | **UNKNOWN** 7.2 dB | **UNKNOWN** 7.0 dB | **UNKNOWN** 7.0 dB |" in top


#: where a name (a defense or attack label) broke across lines inside one of its comma-separated parts
NAME_BREAKS = """
const names = arguments[0], out = [];
const pieces = [...new Set(names.flatMap((n) => n.split(',')).filter((p) => p.length > 3))];
for (const el of document.querySelectorAll('td,th,li,p,figcaption,h2,h3')) {
  const walker = document.createTreeWalker(el, NodeFilter.SHOW_TEXT);
  const nodes = []; let text = '';
  while (walker.nextNode()) { nodes.push([walker.currentNode, text.length]); text += walker.currentNode.data; }
  for (const piece of pieces) {
    let at = text.indexOf(piece);
    while (at >= 0) {
      const range = document.createRange();
      const find = (k) => { for (let i = nodes.length - 1; i >= 0; i--) if (nodes[i][1] <= k) return [nodes[i][0], k - nodes[i][1]]; };
      range.setStart(...find(at)); range.setEnd(...find(at + piece.length - 1)); range.setEnd(range.endContainer, range.endOffset + 1);
      const tops = new Set([...range.getClientRects()].filter((r) => r.width > 0).map((r) => Math.round(r.bottom)));
      if (tops.size > 1) out.push(`${piece} breaks across lines in ${el.tagName.toLowerCase()} '${text.trim().slice(0, 40)}'`);
      at = text.indexOf(piece, at + piece.length);
    }
  }
}
return out;
"""

#: overflow: the page wider than the window, or an element wider than its box unless it is a scroll
#: box (overflow-x auto) that itself lies inside the window
CLIPPED = """
const out = [], W = document.documentElement.clientWidth;
if (document.documentElement.scrollWidth > W + 1) out.push(`page wider than the window: ${document.documentElement.scrollWidth} > ${W}`);
for (const e of document.body.querySelectorAll('*')) {
  const st = getComputedStyle(e);
  if (st.display === 'inline' || e.clientWidth === 0) continue;
  const box = e.parentElement && e.parentElement.closest('div.scroll');
  if (box) continue;  // inside a scroll box: it scrolls there (the box itself is checked)
  const r = e.getBoundingClientRect();
  if (r.right > W + 1) out.push(`past the window's right edge: ${e.tagName.toLowerCase()} (${Math.round(r.right)} > ${W})`);
  if (e.scrollWidth <= e.clientWidth + 1) continue;
  if (['auto', 'scroll'].includes(st.overflowX)) continue;
  out.push(`clipped: ${e.tagName.toLowerCase()} '${(e.textContent || '').trim().slice(0, 40)}' (${e.scrollWidth} > ${e.clientWidth})`);
}
return out;
"""


def test_report_at_800_and_1400_px_shows_the_matrix_first_and_clips_nothing(tmp_path: Path) -> None:
    """report.html in headless chromium at 800 and 1400 px (screenshots under tmp_path/screens):
    the matrices within the first screen, no table or figure clipped (a wide one scrolls in its own
    box inside the window), no overlapping text, no name broken inside a word."""
    summary, examples = summary_and_examples()
    write_reports(summary, tmp_path, examples)
    names = sorted({n for t in summary["tasks"].values() for n in [*t["utility"], *t["attacker_knows"]]})
    screens = tmp_path / "screens"
    screens.mkdir()
    browser = _browser()
    try:
        for width in (800, 1400):
            browser.set_window_size(width, 900)
            browser.get((tmp_path / "report.html").as_uri())
            browser.execute_script("return document.fonts.ready")
            assert browser.save_screenshot(str(screens / f"report_{width}.png"))
            height = browser.execute_script("return window.innerHeight")
            matrices = browser.execute_script(
                "return [...document.querySelectorAll('table.matrix')].map((t) => t.getBoundingClientRect().bottom)"
            )
            assert len(matrices) == 2, f"at {width} px: one matrix per task"
            assert max(matrices) <= height, f"at {width} px: matrices end at {matrices}, the screen at {height}"
            problems = browser.execute_script(CLIPPED)
            problems += [p for p in browser.execute_script(CHECK) if p.startswith(("overlap", "image"))]
            problems += browser.execute_script(NAME_BREAKS, names)
            assert not problems, f"at {width} px:\n" + "\n".join(problems)
        browser.set_window_size(800, 900)
        browser.execute_script(BROKEN)
        caught = "\n".join(browser.execute_script(CLIPPED))
        assert "clipped: td 'aVeryLongUnbrokenWord'" in caught
    finally:
        browser.quit()


def _readme_numbers() -> Any:
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "scripts" / "readme_numbers.py"
    spec = importlib.util.spec_from_file_location("readme_numbers", path)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


def test_readme_numbers_are_pasted_from_the_run_and_checked_against_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """scripts/readme_numbers.py RUN rewrites the README's blocks from RUN/summary.json (no timing
    column: it differs between runs), --check then passes and fails once a number differs; a run
    of another scenario is refused in one line."""
    import json

    import yaml

    from veil.experiments.scenario import default_scenario_path

    rn = _readme_numbers()
    summary, _ = summary_and_examples()
    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({**summary, "config": {"name": "report-check"}}))
    readme = tmp_path / "README.md"
    readme.write_text(
        "intro\n<!-- quickstart:start -->\nold\n<!-- quickstart:end -->\n"
        "<!-- headline:start -->\nold\n<!-- headline:end -->\nend\n"
    )
    with pytest.raises(SystemExit, match="not a run of the embedded quickstart scenario"):
        rn.main([str(run), "--readme", str(readme)])
    quickstart = yaml.safe_load(default_scenario_path().read_text())
    (run / "summary.json").write_text(json.dumps({**summary, "config": quickstart}))
    assert rn.main([str(run), "--readme", str(readme)]) == 0
    text = readme.read_text()
    assert text.startswith("intro\n") and text.endswith("end\n")
    assert "| `april` | **LEAKS** 119.1 dB | **PARTLY** 12.1 dB | **HOLDS** 7.9 dB |" in text
    assert "| none | april | 119.1 | 1.000 |" in text  # the whole-image table, without its seconds
    assert "seconds" not in rn.block(text, "quickstart").split("*Measured")[0]
    assert "**none**: accuracy 0.928; worst case `april`: psnr 119.1 dB (whole image)" in text
    assert rn.main([str(run), "--readme", str(readme), "--check"]) == 0
    readme.write_text(text.replace("119.1 dB", "118.5 dB", 1))
    assert rn.main([str(run), "--readme", str(readme), "--check"]) == 1
    assert "differs from" in capsys.readouterr().err


def test_the_readme_quickstart_numbers_are_those_of_the_collected_quickstart_run() -> None:
    """README.md's quickstart and headline blocks render from docs/results/quickstart.json, the
    summary of a run of the README's command collected by the results book: a number typed by
    hand, or a run re-collected without regenerating the README, fails here."""
    root = Path(__file__).resolve().parent.parent
    rn = _readme_numbers()
    summary = rn.load_run(root / "docs" / "results" / "quickstart.json")
    text = (root / "README.md").read_text()
    fresh = rn.render(text, summary, root)
    for name in ("quickstart", "headline"):
        assert rn.block(text, name) == rn.block(fresh, name), (
            f"README.md's {name} block differs from docs/results/quickstart.json: "
            "python scripts/readme_numbers.py runs/audit (a fresh `veil audit --out runs/audit`) rewrites it"
        )
