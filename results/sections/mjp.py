"""Section mjp: MJP's utility claims (accuracy with / without MJP, Table I; against the training
ratio gamma, Table II; the text models, Tables IV-V; window size, Table VI), its consistency under a
test-time shuffle (Fig. 4) and the PCA of the position embeddings (Table XII), from the
configs/paper/mjp_* scenarios. The step-time overhead below it (section mjp-overhead) is a
benchmark's (benchmarks/mjp_overhead.py), not the engine's."""

from __future__ import annotations

from typing import Any

from results.tables import mean_std, table

SOURCES = ("mjp-table1", "mjp-table2", "mjp-tables4-5", "mjp-table6", "mjp-table12")
LABELS = {"digits": "ViT (vit-digits) on digits", "lfw": "ViT (vit-tiny, depth 4) on LFW faces"}
LABELS |= {"sst2-transformer4": "Transformer4 on SST-2", "sst2-window": "Transformer4 on SST-2"}


def _acc(u: dict[str, Any]) -> list[float]:
    return u.get("test_accuracy_values") or [u["test_accuracy_mean"]]


def _gamma(d: str) -> float:
    return float(d.split("gamma=")[1].split(",")[0].rstrip(")")) if "gamma=" in d else 0.0


def _mjp_key(u: dict[str, Any]) -> str:
    return next(d for d in u if d.startswith("mjp(") and "variant=shuffle" not in d)


def accuracy(s: dict[str, Any], text: dict[str, Any]) -> str:
    rows = []
    for name, t in [*s["tasks"].items(), *text["tasks"].items()]:
        u = t["utility"]
        for d in (x for x in u if x != "none"):
            diff = 100 * (sum(_acc(u[d])) / len(_acc(u[d])) - sum(_acc(u["none"])) / len(_acc(u["none"])))
            rows.append(
                [LABELS.get(name, name), d, mean_std(_acc(u["none"]), 100.0), mean_std(_acc(u[d]), 100.0)]
                + [f"{diff:+.2f}", "yes" if round(diff, 6) >= -1 else "no"]
            )
    header = ["setting", "defense", "undefended", "defended", "defended - undefended", "within 1 point"]
    return (
        "### Accuracy with and without MJP (Tables I, IV-V analogue)\n\n"
        f"Test accuracy (%), mean ± std over seeds {s['seeds']} (`configs/paper/mjp_table1_accuracy.yaml`, "
        f"`mjp_tables4_5_text.yaml`; text seeds {text['seeds']}). Goal: MJP within 1 point of (or above) the "
        "undefended model. MiniLM-L6 on SST-2 with and without MJP: section *Utility of MJP and AEGIS*.\n\n"
        + table(header, rows)
    )


def gamma(s: dict[str, Any]) -> str:
    (name, t), parts = next(iter(s["tasks"].items())), []
    u = t["utility"]
    order = sorted(u, key=_gamma)
    parts.append(
        table(["method", *(f"{_gamma(d):g}" for d in order)], [["mjp", *(mean_std(_acc(u[d]), 100.0) for d in order)]])
    )
    return (
        "### Accuracy vs training gamma (Table II analogue)\n\n"
        f"{LABELS.get(name, name)}, seeds {s['seeds']} (`configs/paper/mjp_table2_gamma.yaml`); gamma 0 is the "
        "undefended model.\n\n" + parts[0]
    )


def consistency(s: dict[str, Any]) -> str:
    t = s["tasks"]["digits"]
    curves = {d: u["evaluations"]["test_shuffle"] for d, u in t["utility"].items() if u.get("evaluations")}
    gammas = list(next(iter(curves.values())))
    rows, drop = [], {}
    for d, c in curves.items():
        drop[d] = 100 * (c["0"] - c["0.27"]) if "0" in c and "0.27" in c else None
        rows.append([d, *(f"{100 * c[g]:.2f}" for g in gammas), "—" if drop[d] is None else f"{drop[d]:.2f}"])
    text = table(["model", *gammas, "drop at 0.27"], rows)
    mjp = _mjp_key(t["utility"])
    if drop.get("none") is not None and drop.get(mjp) is not None:
        ok = drop[mjp] <= 0.5 * drop["none"]
        text += (
            f"\n\nGoal (MJP loses at most half the undefended drop at 0.27): {'met' if ok else 'not met'} "
            f"({drop[mjp]:.2f} vs {drop['none']:.2f} points)."
        )
    return (
        "### Consistency: accuracy vs test-time gamma (Fig. 4 analogue)\n\n"
        f"ViT on digits, mean over seeds {s['seeds']}; test images shuffled block-wise at each ratio (MJP models put "
        "E_unk at the shuffled slots; `evaluate: {test_shuffle}` in `configs/paper/mjp_table1_accuracy.yaml`).\n\n"
        + text
    )


def window(s: dict[str, Any]) -> str:
    (name, t) = next(iter(s["tasks"].items()))
    rows = {}
    for d, u in t["utility"].items():
        method = "shuffle" if "variant=shuffle" in d else "mjp"
        w = d.split("window=")[1].split(",")[0].rstrip(")")
        rows.setdefault(method, {})[w] = mean_std(_acc(u), 100.0)
    windows = sorted({w for r in rows.values() for w in r}, key=int)
    body = [[m, *(r.get(w, "—") for w in windows)] for m, r in rows.items()]
    return (
        "### Window size (Table VI analogue)\n\n"
        f"{LABELS.get(name, name)}, gamma 0.5, seeds {s['seeds']} (`configs/paper/mjp_table6_window.yaml`).\n\n"
        + table(["method", *windows], body)
    )


def pca(image: dict[str, Any], text: dict[str, Any]) -> str:
    rows = []
    for s in (image, text):
        for name, t in s["tasks"].items():
            for d, u in t["utility"].items():
                ev = (u.get("evaluations") or {}).get("pe")
                if ev:
                    rows.append([f"{LABELS.get(name, name)}, {d}", *(f"{v:.2f}" for v in ev.values())])
    dims = max(len(r) for r in rows) - 1
    return (
        "### PCA of the position embeddings (Table XII analogue)\n\n"
        "Cumulative explained variance (%) by projected dimension, mean over seeds (`evaluate: {pe: 10}` in "
        "`configs/paper/mjp_table12_pca.yaml` and `mjp_tables4_5_text.yaml`).\n\n"
        + table(["model", *(str(i) for i in range(1, dims + 1))], rows)
    )


def render(summaries: dict[str, dict[str, Any]]) -> str:
    t1, t2, t45 = summaries["mjp-table1"], summaries["mjp-table2"], summaries["mjp-tables4-5"]
    parts = [
        "## MJP (Masked Jigsaw Puzzle)",
        "Trained by `veil audit configs/paper/mjp_*.yaml`, rendered by `python -m results`; never edit by "
        "hand. MJP: images gamma 0.1 (block selection, DAL lambda 0.01) unless a table varies it; text gamma 0.5, window "
        "32 unless a table varies it.",
        accuracy(t1, t45),
        gamma(t2),
        consistency(t1),
        window(summaries["mjp-table6"]),
        pca(summaries["mjp-table12"], t45),
    ]
    return "\n\n".join(parts)
