"""Render an audit summary as report.md and a self-contained report.html (PNGs embedded).

Both are built from one list of blocks, so they always show the same numbers as summary.json.
The report reads nothing of the audit's folder layout: it takes the summary and the examples the
engine hands it (`veil.experiments.cells.examples`: per task, records {defense, attack,
example}); a protocol's own blocks come from the protocol registered under its name.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from veil.io import atomic_write_text
from veil.metrics.leakage import cell_leakage, describe, fmt, leak_text
from veil.registry import PROTOCOLS
from veil.report.census import census_blocks
from veil.report.dp_audit import audit_blocks, claim_note
from veil.report.figures import CAP_DB, privacy_utility, reconstruction_grid, wrap
from veil.report.headline import IMAGE_BANDS, TEXT_BANDS, glance_blocks
from veil.report.markup import to_html, to_markdown

Block = tuple  # the kinds are listed in veil.report.markup (h1-h3, p, pre, table, img, tokens, glance)

SHOWN = (
    "psnr",
    "ssim",
    "psnr_unshuffled",
    "ssim_unshuffled",
    "psnr_masked_set",
    "masked_patches",
    "moved_patches",
    "mse",
    "fft2d",
    "token_recovery",
    "rouge1",
    "rouge2",
    "exact_recovery",
    "presence_f1",
    "unshuffled_recovery",
    "bag_recall",
    "moved_tokens",
    "label_accuracy",
    "seconds",
)


#: what the engine hands the report beside the summary: per task, the cells' example records
Examples = dict[str, list[dict[str, Any]]]


def slug(text: str) -> str:
    """A file-name-safe form of a label such as mjp(gamma=0.1)."""
    return "".join(c if c.isalnum() or c in "-." else "_" for c in text).strip("_")


def aligned(ref: list[str], hyp: list[str]) -> list[tuple[str, bool]]:
    """The rebuilt tokens, each flagged right (same token at the same position) or wrong."""
    return [(tok, i < len(ref) and ref[i] == tok) for i, tok in enumerate(hyp)]


def task_blocks(name: str, t: dict[str, Any], out: Path, examples: list[dict[str, Any]] | None = None) -> list[Block]:
    """One task's blocks: verdict, protocol blocks, utility, every attack, figures, examples."""
    blocks: list[Block] = [("h2", f"Task `{name}` — {t['model']} on {t['data']} ({t['protocol']})")]
    blocks.append(
        (
            "p",
            f"Client dropout during the attacked step: {t['dropout']}. Attacker knowledge: {json.dumps(t['knowledge'])}; "
            f"{t['samples']} attacked client steps per cell.",
        )
    )
    rows = []
    for d, u in t["utility"].items():
        acc = (
            f"{u['test_accuracy_mean']:.4f} ± {u['test_accuracy_std']:.4f}"
            if "test_accuracy_mean" in u
            else "— (attacked at init)"
        )
        ppl = f"{u['test_perplexity_mean']:.2f}" if "test_perplexity_mean" in u else "—"
        rows.append(
            [d, acc, ppl, f"{t['overhead'].get(d, float('nan')):.3f}", f"{t['step_seconds'].get(d, float('nan')):.4f}"]
        )
    blocks += worst_case_blocks(t)
    if t["protocol"] != "single-step":  # per round / per protocol: the protocol's own blocks
        blocks += PROTOCOLS.create(t["protocol"]).report_blocks(t, out)
    blocks += audit_blocks(name, t, out)  # claimed epsilon vs epsilon-hat, membership inference (if measured)
    blocks.append(("h3", "Utility and cost"))
    blocks.append(
        (
            "table",
            ["defense", "test accuracy (mean ± std over seeds)", "perplexity", "step time vs none", "step s"],
            rows,
        )
    )
    for d, u in t["utility"].items():
        if u.get("privacy"):
            pv = u["privacy"]
            blocks.append(
                (
                    "p",
                    f"Privacy of `{d}`: epsilon = {pv['epsilon']} at delta = {pv['delta']:.3g} ({pv['accountant']} accountant, "
                    f"noise multiplier {pv['noise_multiplier']:.3f}, sample rate {pv['sample_rate']:.4g}, {pv['steps']} steps, "
                    f"per-sample gradients: {pv['mode']}). {claim_note(t, d)}",
                )
            )
    blocks.append(("h3", "Every attack (defense × attack, naive and adaptive)"))
    metrics = [m for m in SHOWN if any(m in cell for att in t["leakage"].values() for cell in att.values())]
    rows = [
        [d, a, *[fmt(cell.get(m, "—")) for m in metrics]] for d, att in t["leakage"].items() for a, cell in att.items()
    ]
    blocks.append(("table", ["defense", "attack", *metrics], rows))
    for d, att in t["blocked"].items():
        for a, why in att.items():
            still = (
                describe(t["worst_case"][d])
                if t.get("worst_case", {}).get(d, {}).get("attack")
                else "no other attack measured leakage"
            )
            blocks.append(
                (
                    "p",
                    f"Blocked: `{a}` could not run against `{d}` — {why}. The defense closed the channel this attack reads; "
                    f"still worked against `{d}`: {still}.",
                )
            )
    for a, why in t["skipped"].items():
        blocks.append(("p", f"Skipped `{a}`: {why}"))
    blocks += census_blocks(t)
    blocks += figure_blocks(name, t, out, examples)
    for record in examples or []:
        d, a, ex = record["defense"], record["attack"], record["example"]
        if "references" in ex:
            rows = [(" ".join(r), aligned(r, h)) for r, h in zip(ex["references"], ex["reconstructions"])]
            blocks.append(("tokens", f"{a} against defense {d}", rows))
    return blocks


def figure_blocks(name: str, t: dict[str, Any], out: Path, examples: list[dict[str, Any]] | None) -> list[Block]:
    """The task's privacy-utility figure (every attack that rebuilt input, at each defense's accuracy)
    and one grid of what the image attacks rebuilt (one column per cell, originals above)."""
    blocks: list[Block] = []
    worst = {d: (wc or {}).get("attack") for d, wc in t.get("worst_case", {}).items()}
    points, labels_only = [], []
    for d, att in t["leakage"].items():
        for a, m in att.items():
            cl = cell_leakage(m)
            if cl is None or "test_accuracy_mean" not in t["utility"].get(d, {}):  # untrained: no accuracy to plot
                continue
            if cl["tier"] == 0:
                labels_only.append(f"{a} vs {d} {fmt(float(cl['value']))}")
                continue
            points.append((d, a, float(t["utility"][d]["test_accuracy_mean"]), float(cl["score"]), worst.get(d) == a))
    if points:
        image = any(m.startswith("psnr") for metrics in t["leakage"].values() for c in metrics.values() for m in c)
        path = privacy_utility(
            points,
            out / "figures" / f"{slug(name)}_privacy_utility.png",
            f"{name}: privacy vs utility, every attack at each defense",
            image,
            IMAGE_BANDS if image else TEXT_BANDS,
        )
        capped = [f"{a} vs {d}" for d, a, _, y, _ in points if image and y >= CAP_DB]
        caption = (
            "Privacy-utility: one point per defense x attack (colour: defense, marker: attack; filled: the worst case); "
            "up is more leakage, right is more accuracy; shaded bands: the verdicts of the headline."
        )
        if capped:
            caption += f" Drawn at 100 dB (an exact copy; inf included): {', '.join(capped)}."
        if labels_only:
            caption += f" Labels only, not on the axis (label accuracy): {', '.join(labels_only)}."
        blocks.append(("img", path, caption))
    columns = []
    for record in examples or []:
        d, a, ex = record["defense"], record["attack"], record["example"]
        if "original" in ex:
            n = min(len(ex["original"]), len(ex["reconstruction"]), 4)
            for i in range(n):
                label = wrap(a, 22) + "\n" + wrap(f"vs {d}", 22) + (f" #{i}" if n > 1 else "")
                columns.append((label, ex["original"][i], ex["reconstruction"][i]))
    if examples:
        blocks.append(("h3", "What the server rebuilt"))
    if columns:
        path = reconstruction_grid(columns[:24], out / "figures" / f"{slug(name)}_reconstructions.png")
        blocks.append(
            (
                "img",
                path,
                "Originals (top row of each band) above what each attack rebuilt against each defense "
                "(first attacked sample of the first seed; pixels upsampled, nearest neighbour).",
            )
        )
    return blocks


def worst_case_blocks(t: dict[str, Any]) -> list[Block]:
    """The verdict first: per defense, the attack that rebuilt the most, what it knew, what it got."""
    rows = []
    for d, wc in t.get("worst_case", {}).items():
        blocked = ", ".join(wc["blocked"]) or "—"
        if wc["attack"] is None:
            rows.append([d, "—", "no attack measured leakage", "—", blocked])
            continue
        rows.append([d, wc["attack"], leak_text(wc), wc["knows"], blocked])
    if not rows:
        return []
    return [
        ("h3", "Worst case per defense (the strongest attack that ran)"),
        (
            "table",
            ["defense", "strongest attack", "leakage (region; beside)", "attacker knows", "blocked by the defense"],
            rows,
        ),
        (
            "p",
            "Images: PSNR of the best-rebuilt region (unshuffled patches at their positions, or the whole image). "
            "Text: the bag of words (ROUGE-1 / presence F1) plus the share of tokens in place decides; the rows below "
            "list every attack, naive ones included.",
        ),
    ]


def summary_blocks(summary: dict[str, Any], out: Path, examples: Examples | None = None) -> list[Block]:
    """The whole report's blocks: the headline (veil.report.headline), every task, the software, the scenario."""
    blocks: list[Block] = [("h1", f"veil audit: {summary['scenario']}"), *glance_blocks(summary)]
    blocks.append(("p", f"Seeds: {summary['seeds']}. Numbers: summary.json (same keys as below)."))
    for name, t in summary["tasks"].items():
        blocks += task_blocks(name, t, out, (examples or {}).get(name))
    blocks.append(("h2", "Software"))
    blocks.append(("table", ["package", "version"], [[k, v] for k, v in summary["versions"].items()]))
    blocks.append(("h2", "Scenario"))
    blocks.append(("pre", yaml.safe_dump(summary["config"], sort_keys=False)))
    return blocks


def write_reports(summary: dict[str, Any], out: Path, examples: Examples | None = None) -> None:
    """report.md and report.html in `out` (figures under out/figures)."""
    blocks = summary_blocks(summary, out, examples)
    atomic_write_text(out / "report.md", to_markdown(blocks, out))
    atomic_write_text(out / "report.html", to_html(blocks))
