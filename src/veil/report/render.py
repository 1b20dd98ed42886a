"""Render an audit summary as report.md and a self-contained report.html (PNGs embedded).

Both are built from one list of blocks, so they always show the same numbers as summary.json.
The report reads nothing of the audit's folder layout: it takes the summary and the examples the
engine hands it (`veil.experiments.cells.examples`: per task, records {defense, attack,
example}); a protocol's own blocks come from the protocol registered under its name.
"""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path
from typing import Any

import yaml

from veil.io import atomic_write_text
from veil.metrics.leakage import describe, fmt, leak_text
from veil.registry import PROTOCOLS
from veil.report.figures import image_grid, privacy_utility

Block = tuple  # ("h2", text) | ("p", text) | ("table", header, rows) | ("img", path, caption) | ("tokens", rows)

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
        acc = f"{u['test_accuracy_mean']:.4f} ± {u['test_accuracy_std']:.4f}"
        ppl = f"{u['test_perplexity_mean']:.2f}" if "test_perplexity_mean" in u else "—"
        rows.append(
            [d, acc, ppl, f"{t['overhead'].get(d, float('nan')):.3f}", f"{t['step_seconds'].get(d, float('nan')):.4f}"]
        )
    blocks += worst_case_blocks(t)
    if t["protocol"] != "single-step":  # per round / per protocol: the protocol's own blocks
        blocks += PROTOCOLS.create(t["protocol"]).report_blocks(t, out)
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
                    f"per-sample gradients: {pv['mode']}).",
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
    points = [
        (d, wc["attack"], t["utility"][d]["test_accuracy_mean"], min(float(wc["score"]), 100.0))
        for d, wc in t.get("worst_case", {}).items()
        if wc.get("attack") and d in t["utility"]
    ]
    if points:
        image = any(t["worst_case"][d]["metric"].startswith("psnr") for d, *_ in points)
        ylabel = "worst-case PSNR, dB (capped at 100: an exact copy)" if image else "worst-case words + in place (0-2)"
        path = privacy_utility(
            points, ylabel, out / "figures" / f"{slug(name)}_privacy_utility.png", f"{name}: privacy vs utility"
        )
        blocks.append(
            (
                "img",
                path,
                "Privacy-utility: each point is a defense at its worst case (the strongest attack, named); "
                "up is more leakage, right is more accuracy.",
            )
        )
    blocks.append(("h3", "What the server rebuilt"))
    for record in examples or []:
        d, a, ex = record["defense"], record["attack"], record["example"]
        if "original" in ex:
            path = image_grid(
                ex["original"],
                ex["reconstruction"],
                out / "figures" / f"{slug(name)}_{slug(d)}_{slug(a)}.png",
                f"{a} vs {d}",
            )
            blocks.append(("img", path, f"{a} against defense {d}: originals (top), reconstructions (bottom)."))
        elif "references" in ex:
            rows = [(" ".join(r), aligned(r, h)) for r, h in zip(ex["references"], ex["reconstructions"])]
            blocks.append(("tokens", f"{a} against defense {d}", rows))
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
    """The whole report's blocks: every task, the software versions, the scenario."""
    blocks: list[Block] = [
        ("h1", f"veil audit: {summary['scenario']}"),
        ("p", f"Seeds: {summary['seeds']}. Numbers: summary.json (same keys as below)."),
    ]
    for name, t in summary["tasks"].items():
        blocks += task_blocks(name, t, out, (examples or {}).get(name))
    blocks.append(("h2", "Software"))
    blocks.append(("table", ["package", "version"], [[k, v] for k, v in summary["versions"].items()]))
    blocks.append(("h2", "Scenario"))
    blocks.append(("pre", yaml.safe_dump(summary["config"], sort_keys=False)))
    return blocks


def to_markdown(blocks: list[Block], out: Path) -> str:
    lines: list[str] = []
    for b in blocks:
        kind = b[0]
        if kind in ("h1", "h2", "h3"):
            lines += ["#" * int(kind[1]) + " " + b[1], ""]
        elif kind == "p":
            lines += [b[1], ""]
        elif kind == "pre":
            lines += ["```yaml", b[1].rstrip(), "```", ""]
        elif kind == "table":
            lines += ["| " + " | ".join(b[1]) + " |", "|" + "---|" * len(b[1])]
            lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in b[2]] + [""]
        elif kind == "img":
            lines += [f"![{b[2]}]({Path(b[1]).relative_to(out)})", "", f"*{b[2]}*", ""]
        elif kind == "tokens":
            lines += [f"**{b[1]}** (wrong tokens struck through)", ""]
            for ref, toks in b[2]:
                lines += [f"- true: {ref}", "  rebuilt: " + " ".join(t if ok else f"~~{t}~~" for t, ok in toks)]
            lines.append("")
    return "\n".join(lines)


def to_html(blocks: list[Block]) -> str:
    e = html.escape
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>veil audit</title><style>",
        "body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}",
        "table{border-collapse:collapse;margin:.5em 0 1.2em}td,th{border:1px solid #ccc;padding:3px 8px;font-size:13px;text-align:right}",
        "th{background:#f3f3f3}td:first-child,td:nth-child(2){text-align:left}.bad{color:#b00;text-decoration:line-through}",
        "pre{background:#f6f6f6;padding:1em;font-size:12px}figure{margin:1em 0}figcaption{font-size:12px;color:#555}",
        "</style></head><body>",
    ]
    for b in blocks:
        kind = b[0]
        if kind in ("h1", "h2", "h3"):
            parts.append(f"<{kind}>{e(b[1]).replace('`', '')}</{kind}>")
        elif kind == "p":
            parts.append(f"<p>{e(b[1]).replace('`', '')}</p>")
        elif kind == "pre":
            parts.append(f"<pre>{e(b[1])}</pre>")
        elif kind == "table":
            head = "".join(f"<th>{e(h)}</th>" for h in b[1])
            body = "".join("<tr>" + "".join(f"<td>{e(str(c))}</td>" for c in row) + "</tr>" for row in b[2])
            parts.append(f"<table><tr>{head}</tr>{body}</table>")
        elif kind == "img":
            data = base64.b64encode(Path(b[1]).read_bytes()).decode()
            parts.append(
                f"<figure><img src='data:image/png;base64,{data}' alt='{e(b[2])}'><figcaption>{e(b[2])}</figcaption></figure>"
            )
        elif kind == "tokens":
            parts.append(f"<p><b>{e(b[1])}</b> (wrong tokens in red)</p><ul>")
            for ref, toks in b[2]:
                rebuilt = " ".join(e(t) if ok else f"<span class='bad'>{e(t)}</span>" for t, ok in toks)
                parts.append(f"<li>true: {e(ref)}<br>rebuilt: {rebuilt}</li>")
            parts.append("</ul>")
    parts.append("</body></html>")
    return "\n".join(parts)


def write_reports(summary: dict[str, Any], out: Path, examples: Examples | None = None) -> None:
    """report.md and report.html in `out` (figures under out/figures)."""
    blocks = summary_blocks(summary, out, examples)
    atomic_write_text(out / "report.md", to_markdown(blocks, out))
    atomic_write_text(out / "report.html", to_html(blocks))
