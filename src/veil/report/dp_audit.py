"""The report's blocks for a task's privacy-claim audit and membership inference (tables
``dp_audit`` and ``membership`` of a `protocol: dp-audit` task, `veil.experiments.dp_audit`), and
the log-scale ROC figure.

Claimed epsilon (the accountant's) stands beside the measured epsilon-hat (Steinke, Nasr,
Jagielski 2023 one-run bound, a lower bound at the stated confidence). epsilon-hat above the claim
cannot happen to a correct mechanism (short of the 1 - confidence chance of a false alarm): the
row says "bug in the mechanism", never that the data leaked more than promised. A defense that
claims no epsilon (none, MJP, AEGIS) gets its epsilon-hat as the empirical figure to compare.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from veil.report.figures import wrap  # noqa: E402

BUG = "BUG in the mechanism: epsilon-hat above the claimed epsilon"


def fmt_claim(e: Any) -> str:
    if e is None:
        return "none claimed"
    return "inf (no noise)" if e == "inf" or not math.isfinite(float(e)) else f"{float(e):.3g}"


def verdict(entry: dict[str, Any]) -> str:
    """What a row of the claim-vs-measurement table says."""
    if entry.get("flagged"):
        return f"**{BUG}**"
    c = entry.get("claimed_epsilon")
    if c is None:
        return "no claim: epsilon-hat is the empirical figure"
    if c == "inf":
        return "no finite claim to check"
    return "consistent with the claim"


def claim_note(t: dict[str, Any], d: str) -> str:
    """The sentence a DP cell's privacy line ends with: its measured epsilon-hat, or that it was not audited."""
    e = t.get("dp_audit", {}).get(d)
    if e is None:
        return "Measured epsilon-hat: not audited here (a `protocol: dp-audit` task measures it)."
    tail = f" {BUG}." if e.get("flagged") else ""
    return f"Measured epsilon-hat (one-run audit, {100 * e['confidence']:g} %): {e['eps_hat']:.3f} at delta {e['delta']:.3g}.{tail}"


def bound_text(a: dict[str, Any] | None) -> str:
    """epsilon-hat and the guesses behind it: '0.42 (r 200, v 130 of m 1000; ceiling 5.04)'."""
    if not a:
        return "—"
    return f"{a['eps_hat']:.3f} (r {a['r']}, v {a['v']} of m {a['m']}; ceiling {a.get('ceiling', float('nan')):.2f})"


def claim_rows(t: dict[str, Any]) -> list[list[str]]:
    rows = []
    for d, e in t.get("dp_audit", {}).items():
        acc = t.get("utility", {}).get(d, {}).get("test_accuracy_mean")
        rows.append(
            [
                d,
                fmt_claim(e.get("claimed_epsilon")),
                f"{e['delta']:.3g}",
                bound_text(e.get("white_box")),
                bound_text(e.get("black_box")),
                f"{e['eps_hat']:.3f}",
                "—" if acc is None else f"{acc:.4f}",
                verdict(e),
            ]
        )
    return rows


def membership_rows(t: dict[str, Any]) -> list[list[str]]:
    rows = []
    for d, attacks in t.get("membership", {}).items():
        for a, m in attacks.items():
            name = a if a != "lira" else f"lira (offline, {int(m.get('references', 0))} references)"
            rows.append([d, name, *membership_figures(m)])
    return rows


def membership_figures(m: dict[str, Any]) -> list[str]:
    """One membership attack's TPR at 0.1 % and 1 % FPR (in %), its AUC and the members / non-members it scored."""
    return [
        f"{100 * m['tpr_at_0.001']:.2f}",
        f"{100 * m['tpr_at_0.01']:.2f}",
        f"{m['auc']:.3f}",
        f"{int(m['members'])} / {int(m['nonmembers'])}",
    ]


def roc_figure(curves: dict[str, list[list[float]]], path: Path, title: str) -> Path:
    """ROC curves on log-log axes (FPR 1e-4..1), the chance diagonal dashed; one colour per
    defense, one line style per attack (keys 'defense: attack'); the legend beside, labels wrapped."""
    fig = plt.figure(figsize=(10.0, 5.0), dpi=100)
    ax = fig.add_axes((0.08, 0.11, 0.44, 0.8))
    grid = [10 ** (-4 + 4 * i / 50) for i in range(51)]
    ax.plot(grid, grid, ls=(0, (2, 2)), color="#999999", lw=1, label="chance")
    defenses = list(dict.fromkeys(k.rsplit(": ", 1)[0] for k in curves))
    attacks = list(dict.fromkeys(k.rsplit(": ", 1)[-1] for k in curves))
    colours = plt.get_cmap("tab10")
    styles = ["-", "--", ":", "-."]
    for name, pts in curves.items():
        d, a = name.rsplit(": ", 1)
        ax.step(
            [p[0] for p in pts],
            [max(p[1], 1e-4) for p in pts],
            where="post",
            lw=1.5,
            color=colours(defenses.index(d) % 10),
            ls=styles[attacks.index(a) % len(styles)],
            label=wrap(f"{d}: {a}", 48),
        )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(1e-4, 1)
    ax.set_ylim(1e-4, 1.05)
    ax.set_xlabel("false-positive rate")
    ax.set_ylabel("true-positive rate")
    ax.set_title(title, fontsize=10)
    ax.legend(loc="upper left", bbox_to_anchor=(1.03, 1.0), fontsize=7, frameon=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def curves_of(t: dict[str, Any]) -> dict[str, list[list[float]]]:
    """Every (defense, attack)'s ROC points, labelled 'defense: attack'."""
    return {f"{d}: {a}": m["curve"] for d, attacks in t.get("membership", {}).items() for a, m in attacks.items()}


def slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-." else "_" for c in text).strip("_")


def audit_blocks(name: str, t: dict[str, Any], out: Path) -> list[tuple]:
    """The task's claim-vs-measurement table, its membership table and ROC figure ([] without them)."""
    blocks: list[tuple] = []
    if t.get("dp_audit"):
        c = t.get("canaries", {})
        where = sorted({e["white_box"]["coordinates"] for e in t["dp_audit"].values() if e.get("white_box")})
        blocks += [
            ("h3", "Privacy claim vs one-run audit (epsilon-hat)"),
            (
                "table",
                ["defense", "claimed epsilon", "delta", "epsilon-hat, white-box gradient canaries"]
                + ["epsilon-hat, black-box input canaries", "epsilon-hat", "test accuracy", "reading"],
                claim_rows(t),
            ),
            (
                "p",
                f"One training run per defense with {c.get('gradient', 0)} white-box gradient canaries (a crafted "
                f"per-sample gradient on {', '.join(where) or 'coordinates'} of its own, read in every exported "
                f"update) and {c.get('input', 0)} black-box input canaries (mislabelled samples "
                "read from the released model's loss), each included with probability 1/2. epsilon-hat is Steinke, Nasr "
                f"and Jagielski's (2023) one-run lower bound at the row's delta, {100 * c.get('confidence', 0.95):g} % "
                "confidence over every guess count tried (Bonferroni); r guesses, v right; the ceiling is what the "
                "audit reports when every guess is right (its most, whatever the mechanism). A lower bound: "
                "epsilon-hat below the claim does not prove the claim, it fails to refute it. epsilon-hat above a "
                "claimed epsilon is a bug in the mechanism (clipping, noise or accounting), not a privacy finding.",
            ),
        ]
    rows = [
        [d, f"{100 * m['tpr_at_0.001']:.2f}", f"{100 * m['tpr_at_0.01']:.2f}", f"{m['auc']:.3f}"]
        + [f"{int(m['members'])} / {int(m['nonmembers'])}"]
        for d, u in t.get("utility", {}).items()
        if (m := (u.get("evaluations") or {}).get("membership"))
    ]
    if rows:  # `evaluate: {membership: true}` of a single-step task
        blocks += [
            ("h3", "Membership inference (loss attack): training split vs test split"),
            ("table", ["defense", "TPR at 0.1 % FPR (%)", "TPR at 1 % FPR (%)", "AUC", "members / non-members"], rows),
            (
                "p",
                "Yeom et al.'s loss threshold on the released model of each defense; the test split stands for the "
                "non-members, so a test split drawn from another source than the training data inflates these "
                "figures (a `protocol: dp-audit` task holds non-members out of the training split itself).",
            ),
        ]
    if t.get("membership"):
        blocks += [
            ("h3", "Membership inference on the released model"),
            (
                "table",
                ["defense", "attack", "TPR at 0.1 % FPR (%)", "TPR at 1 % FPR (%)", "AUC", "members / non-members"],
                membership_rows(t),
            ),
        ]
        path = roc_figure(curves_of(t), out / "figures" / f"{slug(name)}_membership_roc.png", f"{name}: membership ROC")
        blocks.append(
            (
                "img",
                path,
                "Membership inference ROC, log-log (the chance diagonal dashed): training samples against held-out "
                "samples of the same split; with n non-members the smallest FPR is 1/n.",
            )
        )
    return blocks
