"""The report's blocks for the tasks of a protocol other than single-step: FedAvg audited round
by round (its settings, the per-round figure drawn here, accuracy and worst case per round, bytes,
per client) and split learning (each protocol's metrics, bytes and feature attacks). The engines
(`veil.federated.fedavg.audit`, `veil.federated.split.audit`) return data; this module renders it.
A `protocol: dp-audit` task's tables are `veil.report.dp_audit`'s."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from veil.metrics.leakage import cell_leakage, fmt, leak_text


def plot_rounds(rounds: dict[str, list[dict[str, Any]]], path: Path, title: str) -> None:
    """Accuracy and worst-case leakage per round, one line per defense, drawn at `path`."""
    import matplotlib  # loads only when a report draws this figure (not on every fedavg import)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (acc, leak) = plt.subplots(1, 2, figsize=(9.5, 3.4 + 0.25 * len(rounds)))
    ylab, top = "worst-case leakage", 0.0
    for d, rows in rounds.items():
        acc.plot([r["round"] for r in rows], [r["test_accuracy"] for r in rows], marker=".", label=d)
        pts = [
            (r["round"], min(float(r["worst_case"]["value"]), 100.0))
            for r in rows
            if r["worst_case"] and r["worst_case"]["attack"]
        ]
        if pts:
            metrics = {r["worst_case"]["metric"] for r in rows if r["worst_case"] and r["worst_case"]["attack"]}
            ylab = "worst-case " + "/".join(sorted(metrics))
            leak.plot(*zip(*pts), marker="o", label=d)
            top = max(top, max(v for _, v in pts))
    acc.set(xlabel="round", ylabel="test accuracy", title=f"{title}: utility", ylim=(0, 1))
    # from 0, so that rounding-level wobbles of a failed attack do not look like signal
    leak.set(
        xlabel="round",
        ylabel=ylab,
        title="leakage of the strongest attack (up = worse)",
        ylim=(0, max(1.0, top * 1.15)),
    )
    handles, names = acc.get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=1, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.07 * len(rounds), 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def fedavg_blocks(name: str, t: dict[str, Any], out: Path) -> list[tuple]:
    """report.md / report.html: the federated settings, accuracy and worst case per round, bytes, per client."""
    f = t.get("federated", {})
    blocks: list[tuple] = [
        ("h3", "Federated training, audited round by round"),
        (
            "p",
            f"{f.get('mode')} with {f.get('strategy')} on Flower ({f.get('backend')} backend): {f.get('clients')} clients, "
            f"{f.get('partition')} partition (alpha {f.get('alpha')}), {f.get('rounds')} rounds, local epochs "
            f"{f.get('local_epochs')}, local steps {f.get('local_steps') or 'all batches'}; the server audits "
            f"{f.get('audit_clients')} client(s) every {f.get('audit_every')} round(s) on the updates it received. "
            "A FedAvg update mixes several local steps: single-gradient attacks read it as the pseudo-gradient "
            "(w - w_k) / (lr s); `ig-fedavg` simulates the client's local steps (Geiping et al. 2020 sec. 5); "
            "`multi-round` attacks a client's updates averaged over the rounds so far and `multi-round-global` the "
            "difference of consecutive global models (one rebuild, scored against each audited client's samples). A low figure means these attacks, at "
            "these budgets, failed on these updates, not that the updates are safe; a malicious server "
            "(crafted weights) is not modelled.",
        ),
    ]
    if t.get("server_saw"):
        secure = (
            " under Flower's SecAgg+ (`federated.secagg`): the server holds no individual update"
            if f.get("secagg")
            else ""
        )
        blocks.append(
            (
                "p",
                f"Threat model of every figure below{secure}: the server saw {'; '.join(t['server_saw'])}. The worst "
                "case per round is the strongest attack on that view, with what its attacker knows.",
            )
        )
    if t.get("figure"):
        plot_rounds(t["rounds"], out / t["figure"], name)
        blocks.append(
            (
                "img",
                out / t["figure"],
                "Accuracy (left) and the strongest attack's leakage (right) per round, one line per defense.",
            )
        )
    rows = []
    for d, rs in t["rounds"].items():
        for r in rs:
            wc = r["worst_case"]
            leak = f"`{wc['attack']}`: {leak_text(wc)}" if wc and wc["attack"] else "—"
            rows.append(
                [
                    d,
                    r["round"],
                    fmt(r["test_accuracy"]),
                    fmt(r["train_loss"]) if r["train_loss"] is not None else "—",
                    int(r["bytes_down"] + r["bytes_up"]),
                    leak,
                ]
            )
    blocks.append(
        ("table", ["defense", "round", "test accuracy", "train loss", "bytes", "worst case this round"], rows)
    )
    rows = [[d, int(b["bytes_total"]), int(b["bytes_per_round"])] for d, b in t["bytes"].items()]
    blocks.append(("table", ["defense", "bytes (all rounds, down + up)", "bytes per round"], rows))
    rows = []
    for d, by in t["clients"].items():
        for c, att in by.items():
            for a, m in att.items():
                cl = cell_leakage(m)
                rows.append([d, c, a, int(m.get("round", 0)), leak_text(cl) if cl else "no metric"])
    blocks.append(("table", ["defense", "client", "attack", "most-leaking round", "leakage"], rows))
    return blocks


def split_blocks(name: str, t: dict[str, Any], out: Path) -> list[tuple]:
    """report.md / report.html: each protocol's metrics and bytes, and the feature attacks' PSNR side by side."""
    tasks = sorted({k for e in t["split"].values() for k in e["metrics"]})
    attacks = sorted({a for leak in t["leakage"].values() for a in leak})
    rows = []
    for d, e in t["split"].items():
        leak = t["leakage"].get(d, {})
        rows.append(
            [
                d,
                *[fmt(e["metrics"].get(k, "—")) for k in tasks],
                fmt(e.get("bytes_per_client", "—")),
                fmt(e.get("paper_bytes_per_client", "—")),
                *[fmt(leak[a]["psnr"]) if a in leak else "—" for a in attacks],
            ]
        )
    names = next(iter(t["split"].values()))["metric_names"] if t["split"] else {}
    head = [
        "protocol",
        *[f"{k} ({names.get(k, '')})" for k in tasks],
        "bytes per client",
        "paper formula",
        *[f"PSNR {a}" for a in attacks],
    ]
    return [
        ("h3", "Split learning: protocols, bytes and feature-space attacks"),
        (
            "p",
            "Each protocol trained over Flower messages (bytes measured from the serialised messages, beside the paper's formula); "
            "the feature attacks rebuild a client's private images from the head features the server receives "
            "(permuted under p-FeSTA when the permutation defense is on). PSNR in dB; FL and central send no features.",
        ),
        ("table", head, rows),
    ]


#: a protocol's report blocks, by the protocol's registered name (none for single-step and dp-audit)
BLOCKS: dict[str, Callable[[str, dict[str, Any], Path], list[tuple]]] = {"fedavg": fedavg_blocks, "split": split_blocks}


def protocol_blocks(name: str, t: dict[str, Any], out: Path) -> list[tuple]:
    """The blocks of task `name`'s protocol ([] where the report renders the task itself)."""
    render = BLOCKS.get(t.get("protocol", "single-step"))
    return render(name, t, out) if render else []
