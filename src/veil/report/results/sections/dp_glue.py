"""Section dp-glue: DP-SGD on MiniLM-L6 with GLUE's whole SST-2 training set (issue 17's 80 % line):
the test curve of configs/paper/dp_glue.yaml, the validation screen that chose the recipe
(configs/paper/dp_glue_screen.yaml) and the head-embedding attacker against what the recipe exports
(configs/paper/dp_head_embedding.yaml)."""

from __future__ import annotations

from typing import Any

from veil.report.results.sections.dp import GOAL, curve_rows, entries, fmt_eps, screen_rows
from veil.report.results.tables import count, entry_label, mean_std, raw_tasks, table

SOURCES = ("dp-glue", "dp-glue-screen", "dp-head-embedding")

EXPORTS = (
    "**What this recipe exports, and the attacker it faces.** Only the classifier's gradient leaves the client, so "
    "the token attacks (the `recipe parts` rows of the attack table above) read nothing: blocked by what is trained, "
    "not by the noise. The attacker that knows this reads the sentence's frozen MiniLM embedding off that gradient "
    "(`head-embedding`: for a batch of one, dL/dW = (p - y) hᵀ and dL/db = p - y give h exactly) and matches it, "
    "with the same frozen model, against a pool of candidate sentences that holds the private one (an attribution / "
    "membership setting: a strong assumption, the worst case). `veil audit configs/paper/dp_head_embedding.yaml`: "
    "batch-1 updates of test sentences on MiniLM as loaded (pretrained encoder, classifier at init), DP clip 1, "
    "pool = the test split the updates come from; identified = the matched candidate is the private sentence, "
    "token for token:"
)
READING = (
    "AEGIS exports the classifier's gradient untouched (it closes the token channels it names, not the head), so "
    "its 'goal met' verdict in the AEGIS section holds only for the attacks run there. The audit engine grants the "
    "pool (the test split) to an attack that asks for it: `veil attack RUN --attack head-embedding` and any scenario "
    "listing it. What bounds this attacker, and any other, is DP's guarantee: epsilon at delta = 1/N per training "
    "sentence."
)
CHANGED = (
    "What changed from the script-made section this replaces (`scripts/results_dp_glue.py`): the curve and the "
    "screen are the audit engine's runs of veil's loop with the frozen features computed once per audit "
    "(`veil.experiments.features`; the script handed veil's loop features it cached itself), each with a secret "
    "noise seed (the script seeded the noise 1000 + seed); the separate single `veil train` runs are the curve's "
    "runs; the screen's validation rows are the `table` data set's stratified seeded split of train.tsv (the "
    "script's: 5,000 rows of a permutation seeded 10,000); the attacked updates are the engine's cells (the 32 first "
    "updates of the test split's seeded batches)."
)


def _n(v: Any) -> str:
    return count(v, "?")


def _setting(entry: dict[str, Any]) -> tuple[str, str]:
    if entry["name"] != "dpsgd":
        return f"whole model, {entry_label(entry)}", "—"
    s = float(entry.get("noise_multiplier", 0.0))
    part = "head only" if entry.get("trainable") == "classifier" else "whole model, DP-SGD"
    return (f"{part}, no noise" if s == 0 else f"{part}, noise multiplier {s:.3g}"), f"{s:.3g}"


def attack_rows(summary: dict[str, Any], recipe_sigma: float | None = None) -> list[list[Any]]:
    rows = []
    for name, t in summary["tasks"].items():
        for entry in raw_tasks(summary)[name]["defenses"]:
            entry = {"name": entry} if isinstance(entry, str) else entry
            d = entry_label(entry)
            m = t["leakage"].get(d, {}).get("head-embedding")
            what, noise = _setting(entry)
            sigma = entry.get("noise_multiplier")
            if recipe_sigma and sigma and abs(float(sigma) - recipe_sigma) < 1e-3:
                what += " (the recipe's epsilon-8 noise)"
            if m is None:
                why = t["blocked"].get(d, {}).get("head-embedding", "not run")
                rows.append([what, noise, t["samples"], "—", "0 (blocked)", f"blocked: {why[:80]}"])
                continue
            pool = m.get("match_pool")
            rows.append(
                [what, noise, t["samples"], "—" if pool is None else f"{pool:.0f}"]
                + [f"{100 * m.get('exact_recovery', 0.0):.1f} %", f"{m.get('match_cosine', float('nan')):.3f}"]
            )
    return rows


def render(s: dict[str, dict[str, Any]]) -> str:
    curve, screen = s["dp-glue"], s["dp-glue-screen"]
    name = next(iter(curve["tasks"]))
    eight_entry = next(e for e in entries(curve, name) if e.get("target_epsilon") == 8.0)
    u8 = curve["tasks"][name]["utility"].get(entry_label(eight_entry), {})
    eight = u8.get("test_accuracy_values", [])
    p8 = u8.get("privacy", {})
    n = round(1 / p8["delta"]) if p8.get("delta") else None
    srows, best = screen_rows(screen)
    sp = next(iter(next(iter(screen["tasks"].values()))["utility"].values())).get("privacy", {})
    n_screen = round(1 / sp["delta"]) if sp.get("delta") else None
    met = bool(eight) and min(eight) >= GOAL
    header = ["target epsilon", "epsilon spent (delta)", "noise multiplier", "steps", "seeds", "test accuracy (%)"]
    parts = [
        "### The recipe that meets the goal: GLUE's whole SST-2 training set (`configs/dp_minilm_sst2_glue.yaml`)",
        "",
        "Regenerated by `python -m veil.report.results` from `veil audit configs/paper/dp_glue.yaml`, "
        "`dp_glue_screen.yaml` and `dp_head_embedding.yaml` (their `data.path` pointed at GLUE's SST-2); never edit by "
        "hand. This recipe reads GLUE's SST-2 training set from a path (phrases included; veil ships 8,000 of its rows), "
        "trains the classifier on the frozen mean-pooled MiniLM (`trainable: classifier`, `train.frozen_features`: "
        f"the encoder's output is computed once), 64 tokens, epsilon at delta = 1/N (N = {_n(n)}). Test = the "
        "same 872-sentence GLUE dev split.",
        "",
        f"**Test curve** (`{name}`: the config's recipe, seeds {curve['seeds']}, trained on all {_n(n)} rows):",
        "",
        table(header, curve_rows(curve, name)),
        "",
        f"**Goal (issue 17): >= 80 % test accuracy at epsilon 8 — {'met' if met else 'NOT met'}: "
        f"{mean_std(eight, 100.0) if eight else '—'} ({len(eight)} seeds, min "
        f"{100 * min(eight) if eight else float('nan'):.2f}).** The ceiling is the frozen encoder's: non-private "
        "full fine-tuning is in the utility section; DP fine-tuning of the encoder itself (top layers, LoRA) was not "
        "screened here.",
        "",
        EXPORTS,
        "",
        table(
            ["update", "noise multiplier", "updates attacked", "pool", "sentences identified", "mean best cosine"],
            attack_rows(s["dp-head-embedding"], p8.get("noise_multiplier")),
        ),
        "",
        f"The recipe's epsilon-8 noise multiplier on this schedule is {p8.get('noise_multiplier', float('nan')):.4f} "
        f"(epsilon {fmt_eps(p8.get('epsilon'))}); the scenario's head-only row attacks the value the accountant gave "
        "for it when the scenario was written. " + READING,
        "",
        f"**How the recipe was chosen** (`veil audit configs/paper/dp_glue_screen.yaml`): rows held out of GLUE's "
        f"training file (the `table` data set's stratified seeded split), training on the other {_n(n_screen)}, "
        f"epsilon 8 at delta = 1/N of that run; the best validation row: `{best}` (the config's recipe is "
        "`lr3e-2-B2048-E10`). The pool holds SST-2 phrases, so held-out rows can be phrases of a training sentence: "
        "validation overstates test.",
        "",
        table(
            ["variant (lr, logical batch, epochs)", "epsilon (delta)", "noise multiplier", "steps"]
            + ["validation accuracy (%)", "train s"],
            srows,
        ),
        "",
        CHANGED,
    ]
    return "\n".join(parts)
