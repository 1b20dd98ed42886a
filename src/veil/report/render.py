"""Render an audit summary as report.md and a self-contained report.html (PNGs embedded).

Both are built from one list of blocks, so they always show the same numbers as summary.json.
The report reads nothing of the audit's folder layout: it takes the summary and the examples the
engine hands it (`veil.experiments.cells.examples`: per task, records {defense, attack,
example}); a protocol's own blocks come from the protocol registered under its name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from veil.io import atomic_write_text
from veil.metrics.leakage import cell_leakage, describe, fmt
from veil.report.census import census_blocks
from veil.report.dp_audit import audit_blocks, claim_note
from veil.report.figures import CAP_DB, defense_grid, privacy_utility
from veil.report.headline import IMAGE_BANDS, TEXT_BANDS, glance_blocks
from veil.report.markup import to_html, to_markdown
from veil.report.matrix import VERDICTS, attacks_of, cell_verdict, matrix_block
from veil.report.numbers import knowledge_text, mean_std, metric, ratio, seconds, seeds_text
from veil.report.protocols import protocol_blocks
from veil.report.tables import SCORE_TEXT, attack_tables

Block = tuple  # the kinds are listed in veil.report.markup (h1-h3, p, pre, table, img, tokens, glance)

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
            f"{knowledge_text(t.get('knowledge'))} Client dropout during the attacked step: {t['dropout']:g}; "
            f"{t['samples']} attacked client {'step' if t['samples'] == 1 else 'steps'} per cell.",
        )
    )
    rows = []
    for d, u in t["utility"].items():
        n = len(u.get("test_accuracy_values") or [0])
        acc = (
            mean_std(float(u["test_accuracy_mean"]), float(u.get("test_accuracy_std", 0.0)), n, 4)
            if "test_accuracy_mean" in u
            else "— (attacked at init)"
        )
        ppl = f"{u['test_perplexity_mean']:.2f}" if "test_perplexity_mean" in u else "—"
        spread = (t.get("overhead_spread") or {}).get(d)
        rows.append([d, acc, ppl, ratio(t["overhead"].get(d), spread), seconds(t["step_seconds"].get(d))])
    blocks += worst_case_blocks(t)
    blocks += protocol_blocks(name, t, out)  # per round (fedavg) / per protocol (split)
    blocks += audit_blocks(name, t, out)  # claimed epsilon vs epsilon-hat, membership inference (if measured)
    blocks.append(("h3", "Utility and cost"))
    blocks.append(
        (
            "table",
            [
                "defense",
                "test accuracy" + (" (mean ± std over seeds)" if _seeds(t) > 1 else ""),
                "perplexity",
                "step time vs none (median" + (", quartiles)" if t.get("overhead_spread") else ")"),
                "client step",
            ],
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
    blocks.append(("h3", "Every attack (defense × attack, naive and adaptive), by what it rebuilt"))
    blocks += attack_tables(t)
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
    blocks += figure_blocks(name, t, out, in_table_order(t, examples or []))
    return blocks


def _seeds(t: dict[str, Any]) -> int:
    """How many seeds stand behind the task's accuracies (the most of any defense)."""
    return max((len(u.get("test_accuracy_values") or [0]) for u in t["utility"].values()), default=1)


def in_table_order(t: dict[str, Any], examples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The example records sorted as the tables list them: defenses in the utility table's order,
    then attacks in the scenario's."""
    defenses = {d: i for i, d in enumerate(t.get("utility", {}))}
    attacks = {a: i for i, a in enumerate(attacks_of(t))}
    return sorted(
        examples, key=lambda r: (defenses.get(r["defense"], len(defenses)), attacks.get(r["attack"], len(attacks)))
    )


def figure_blocks(name: str, t: dict[str, Any], out: Path, examples: list[dict[str, Any]]) -> list[Block]:
    """The task's privacy-utility figure (every attack that rebuilt input, at each defense's
    accuracy), then what the attacks rebuilt: images as one row per defense (originals first),
    text as the sentences per defense, both in the tables' order."""
    blocks: list[Block] = []
    worst = {d: (wc or {}).get("attack") for d, wc in t.get("worst_case", {}).items()}
    points, labels_only = [], []
    for d in t["utility"]:
        for a, m in t["leakage"].get(d, {}).items():
            cl = cell_leakage(m)
            if cl is None or "test_accuracy_mean" not in t["utility"].get(d, {}):  # untrained: no accuracy to plot
                continue
            if cl["tier"] == 0:
                labels_only.append(f"{a} vs {d} {fmt(float(cl['value']), 2)}")
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
        caption = (
            "Privacy-utility: one point per defense x attack (colour: defense, marker: attack; filled: the worst case); "
            "up is more leakage, right is more accuracy; shaded bands: the verdicts of the matrix. "
            + (
                "y: the PSNR of the best-rebuilt region (the psnr columns of the image tables)."
                if image
                else f"y: the leakage score, words held + words in place, the column `{SCORE_TEXT}` of the text table."
            )
        )
        shown = [(x, min(y, CAP_DB) if image else round(y, 3)) for _, _, x, y, _ in points]
        if len(set(shown)) < len(shown):
            caption += (
                " Points of equal accuracy and leakage are drawn side by side, each tied to its defense's accuracy "
                "by a short line; the legend names them."
            )
        capped = [f"{a} vs {d}" for d, a, _, y, _ in points if image and y >= CAP_DB]
        if capped:
            caption += f" Drawn at 100 dB (an exact copy, ∞ included): {', '.join(capped)}."
        if labels_only:
            caption += f" Labels only, not on the axis (label accuracy): {', '.join(labels_only)}."
        blocks.append(("img", path, caption))
    if examples:
        blocks.append(("h3", "What the server rebuilt"))
    blocks += image_examples(name, t, out, examples)
    for record in examples:
        d, a, ex = record["defense"], record["attack"], record["example"]
        if "references" in ex:
            rows = [(" ".join(r), aligned(r, h)) for r, h in zip(ex["references"], ex["reconstructions"])]
            blocks.append(("tokens", f"{a} against defense {d}", rows))
    return blocks


def image_examples(name: str, t: dict[str, Any], out: Path, examples: list[dict[str, Any]]) -> list[Block]:
    """One grid: a column per image attack (per sample where a cell rebuilt a batch: at most two),
    the originals on top, then one row per defense in the tables' order."""
    found = {(r["defense"], r["attack"]): r["example"] for r in examples if "original" in r["example"]}
    if not found:
        return []
    attacks = [a for a in attacks_of(t) if any(k[1] == a for k in found)]
    defenses = [d for d in t["utility"] if any(k[0] == d for k in found)]
    per = {
        a: max(min(len(ex["original"]), len(ex["reconstruction"])) for (_, b), ex in found.items() if b == a)
        for a in attacks
    }
    per = {a: min(n, 2 if sum(per.values()) <= 6 else 1) for a, n in per.items()}
    columns = [(a, i) for a in attacks for i in range(per[a])]
    labels = [a + (f" #{i}" if per[a] > 1 else "") for a, i in columns]
    originals = [next(ex["original"][i] for (_, b), ex in found.items() if b == a) for a, i in columns]
    rows, notes = [], {}
    for r, d in enumerate(defenses):
        images = []
        for c, (a, i) in enumerate(columns):
            ex = found.get((d, a))
            images.append(ex["reconstruction"][i] if ex is not None and i < len(ex["reconstruction"]) else None)
            if images[-1] is None:
                v, _, _ = cell_verdict(t, d, a)
                notes[(r, c)] = v if v in VERDICTS[4:] else "—"
        rows.append((d, images))
    path = defense_grid(labels, originals, rows, out / "figures" / f"{slug(name)}_reconstructions.png", notes)
    return [
        (
            "img",
            path,
            "The originals (top row), then what each attack (column) rebuilt against each defense (row), in the "
            "tables' order: first attacked sample of the first seed; pixels upsampled, nearest neighbour.",
        )
    ]


def _leak(wc: dict[str, Any]) -> str:
    """The worst case's figure and those beside it, each to the digits of its kind:
    `psnr 62.4 dB (whole image); psnr_exact 0.500, masked_patches 2`."""
    unit = " dB" if wc["metric"].startswith("psnr") and wc["value"] != float("inf") else ""
    beside = ", ".join(f"{k} {metric(k, v)}" for k, v in wc["beside"].items())
    return f"{wc['metric']} {metric(wc['metric'], wc['value'])}{unit} ({wc['region']})" + (
        f"; {beside}" if beside else ""
    )


def worst_case_blocks(t: dict[str, Any]) -> list[Block]:
    """The verdict first: per defense, the attack that rebuilt the most, what it knew, what it got."""
    rows = []
    for d, wc in t.get("worst_case", {}).items():
        blocked = ", ".join(wc["blocked"]) or "—"
        if wc["attack"] is None:
            rows.append([d, "—", "no attack measured leakage", "—", blocked])
            continue
        rows.append([d, wc["attack"], _leak(wc), wc["knows"], blocked])
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
    glance = glance_blocks(summary)
    blocks: list[Block] = [("h1", f"veil audit: {summary['scenario']}"), glance[0]]
    blocks.append(
        (
            "key",
            VERDICTS,
            f"Which defense stops which attack, at what accuracy: a cell is one attack against one defense, "
            f"coloured by its verdict, with the figure the verdict reads (images: PSNR of the rebuilt image; text: "
            f"the score, words held + words in place, 0-2; labels: label accuracy). {seeds_text(summary['seeds']).capitalize()}; "
            "every number is in summary.json.",
        )
    )
    blocks += [matrix_block(name, t) for name, t in summary["tasks"].items() if t.get("utility")]
    blocks += glance[1:]
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
