"""Regenerate the DP-SGD section of docs/results.md (between `<!-- dp:start -->` and `<!-- dp:end -->`)
from cached runs under runs/dp: the privacy-utility curve of DP-SGD on MiniLM / SST-2 (epsilon 1, 3, 8
at delta = 1/N, and non-private), the validation screen that chose the recipe, DP-SGD step time
against Opacus, and the attacks against DP-SGD on minilm and hf-gpt2 beside AEGIS at stated epsilon.

    python scripts/screen_dp_minilm.py --out runs/dp/screen                      # recipe screen (validation)
    for e in 8 3 1; do veil train configs/dp_minilm_sst2.yaml defense.target_epsilon=$e --out runs/dp/minilm-eps$e; done
    python benchmarks/dp_step.py --repeats 10 --json runs/dp/bench.json
    python scripts/results_dp.py --attacks                                       # runs the attack cells (minutes)
    python scripts/results_dp.py                                                 # rewrite the section from the caches
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from resultsdoc import write_section  # noqa: E402

RUNS = ROOT / "runs" / "dp"
EPSILONS = (1, 3, 8)
#: full-model noise levels attacked: the lowest and the middle of the AEGIS section's ladder (0.1 .. 2;
#: noise only grows above), plus the recipe at its epsilon-8 sigma. Compute-bound: a span attack on
#: MiniLM under noise costs minutes on this machine's contended core.
LADDER = (0.1, 1.0)
N_TRAIN, UTILITY_BATCH, UTILITY_STEPS = 8000, 32, 500  # configs/paper/minilm_utility.yaml: 2 epochs of 250 steps


def eps_of(sigma: float, sample_rate: float, steps: int, delta: float) -> float:
    from veil.defenses.dpsgd import epsilon

    return epsilon(sigma, sample_rate, steps, delta)


def fmt_eps(e: Any) -> str:
    if e is None:
        return "—"
    e = float(e)
    return "inf" if not math.isfinite(e) else (f"{e:.3g}" if e < 1000 else f"{e:.2e}")


# ---- privacy-utility -------------------------------------------------------------------------------
def _run(folder: Path, target: Any) -> dict[str, Any] | None:
    """A veil run folder: its summary, or (a run stopped early) its last per-epoch evaluation."""
    import yaml

    if not (folder / "config.yaml").is_file():
        return None
    cfg = yaml.safe_load((folder / "config.yaml").read_text())
    dp = next((d for d in cfg.get("defense") or [] if d["name"] == "dpsgd"), {})
    row = {"target": target, "trainable": dp.get("trainable") or "all", "planned_epochs": cfg["train"]["epochs"]}
    if (folder / "summary.json").is_file():
        return {**row, **json.loads((folder / "summary.json").read_text())}
    evals = (
        [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines() if '"eval"' in x]
        if (folder / "metrics.jsonl").is_file()
        else []
    )
    if not evals:
        return None
    e = evals[-1]
    return {
        **row,
        "epochs": e["epoch"],
        "steps": e["step"],
        "test_accuracy": e["test_accuracy"],
        "stopped": True,
        "privacy": {"epsilon": e.get("epsilon"), "delta": e.get("delta")},
    }


def utility_rows() -> list[dict[str, Any]]:
    """One row per veil run: epsilon 1, 3, 8, then the recipe without noise (noise_multiplier 0)."""
    rows = [_run(RUNS / f"minilm-eps{e}", e) for e in EPSILONS] + [_run(RUNS / "minilm-sigma0", "inf (sigma 0)")]
    return [r for r in rows if r]


def fmt_utility(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| target epsilon | trainable | epochs run / planned (steps) | epsilon spent so far (delta) | test accuracy (%) |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        p = r.get("privacy", {})
        note = " (stopped early for compute)" if r.get("stopped") else ""
        lines.append(
            f"| {r['target']} | `{r['trainable']}` | {r['epochs']} / {r['planned_epochs']} ({r['steps']}){note} | "
            f"{fmt_eps(p.get('epsilon'))} ({p.get('delta') or 0:.3g}) | {100 * r['test_accuracy']:.2f} |"
        )
    return lines


# ---- screen and the cached-encoder curve -------------------------------------------------------------
def _rows(pattern: str) -> list[dict[str, Any]]:
    return [r for f in sorted(RUNS.glob(pattern)) for r in json.loads(f.read_text())]


def fmt_screen() -> list[str]:
    lines = [
        "| variant (part, lr, logical batch, epochs) | target epsilon | noise multiplier | validation accuracy (%) | seconds |",
        "|---|---|---|---|---|",
    ]
    for r in _rows("screen*/screen.json"):
        lines.append(
            f"| {r['variant']} | {r['target_epsilon']:g} | {r['noise_multiplier']:.3f} | {100 * r['accuracy']:.2f} | {r['seconds']:.0f} |"
        )
    return lines


def fmt_curve(folder: str) -> list[str]:
    from statistics import mean, pstdev

    groups: dict[Any, list[dict[str, Any]]] = {}
    for r in _rows(f"{folder}/screen.json"):
        groups.setdefault(r["target_epsilon"], []).append(r)
    lines = [
        "| target epsilon | epsilon spent (delta 1/8,000) | noise multiplier | seeds | test accuracy (%) |",
        "|---|---|---|---|---|",
    ]
    for t in sorted(groups, key=lambda t: math.inf if t is None else t):
        rs = groups[t]
        acc = [100 * r["accuracy"] for r in rs]
        lines.append(
            f"| {'none (clipping, no noise)' if t is None else f'{t:g}'} | {fmt_eps(max(r['epsilon'] for r in rs))} | "
            f"{rs[0]['noise_multiplier']:.3f} | {len(rs)} | {mean(acc):.2f} ± {pstdev(acc):.2f} |"
        )
    return lines


# ---- step time ---------------------------------------------------------------------------------------
def fmt_bench(b: dict[str, Any]) -> list[str]:
    lines = [
        f"MiniLM-L6, batch {b['batch']} x {b['len']} tokens, median of {b['repeats']} interleaved steps, {b['threads']} thread(s); "
        f"veil ghost / Opacus ghost = **{b['veil_ghost_over_opacus_ghost']:.3f}**:",
        "",
        "| variant | median step (s) | ratio to none |",
        "|---|---|---|",
    ]
    lines += [f"| {n} | {b['median_s'][n]:.3f} | {b['ratio_to_none'][n]:.2f} |" for n in b["median_s"]]
    return lines


# ---- attacks -------------------------------------------------------------------------------------------
def recipe_schedule() -> dict[str, Any]:
    """The recipe's sample rate, steps and epsilon-8 sigma, from configs/dp_minilm_sst2.yaml (accountant only)."""
    import yaml

    from veil.defenses.dpsgd import DPSGD

    cfg = yaml.safe_load((ROOT / "configs" / "dp_minilm_sst2.yaml").read_text())
    steps = cfg["train"]["epochs"] * math.ceil(N_TRAIN / cfg["train"]["batch_size"])
    d = DPSGD(target_epsilon=8.0, accountant=cfg["defense"]["accountant"])
    d.prepare(N_TRAIN, cfg["train"]["batch_size"], steps)
    return d.privacy(steps)


def dp_defenses(recipe_sigma: float, model: str) -> dict[str, list[dict[str, Any]]]:
    """The full-model DP-SGD levels and, on minilm, the two screened recipe parts at the recipe's epsilon-8 sigma.
    none / AEGIS are not re-run: their rows in the AEGIS section are valid (no per-sample path)."""
    out = {f"dpsgd s={s:g}": [{"name": "dpsgd", "clip": 1.0, "noise_multiplier": s}] for s in LADDER}
    if model == "minilm":
        for part, trainable in (("head", "classifier"), ("top1", r"layer\.5\.|classifier")):
            out[f"dpsgd {part} s={recipe_sigma:.3f}"] = [
                {"name": "dpsgd", "clip": 1.0, "noise_multiplier": recipe_sigma, "trainable": trainable}
            ]
    return out


def run_attacks(
    models: list[str], recipe_sigma: float, defenses: list[str] | None = None, attacks: list[str] | None = None
) -> list[dict[str, Any]]:
    """The attack cells (optionally only some defenses / attacks), as results_aegis measures them."""
    import results_aegis as ra

    if attacks:
        ra.ATTACKS = attacks
    rows = []
    for m in models:
        ra.DEFENSES = {k: v for k, v in dp_defenses(recipe_sigma, m).items() if not defenses or k in defenses}
        data = {"minilm": "sst2", "hf-gpt2": "agnews"}[m]
        rows += ra.attack_table(
            m, {"name": data, "tokenizer": "wordpiece", "max_len": 24, "train_size": 64, "test_size": 8}, 4, 10
        )
    return rows


def merge(old: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Cached cells with the new ones replacing those of the same (model, defense, attack)."""
    key = lambda r: (r["model"], r["defense"], r["attack"])  # noqa: E731
    fresh = {key(r): r for r in new}
    return [fresh.pop(key(r), r) for r in old] + list(fresh.values())


def sort_cells(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Model, then noise level, then the recipe parts, then results_aegis's attack order."""
    import results_aegis as ra

    models, attacks = ["minilm", "hf-gpt2"], list(ra.ATTACKS)

    def key(r: dict[str, Any]) -> tuple:
        d = r["defense"]
        return (
            models.index(r["model"]) if r["model"] in models else 9,
            (("head" in d) + 2 * ("top1" in d), float(d.split("s=")[1])),
            attacks.index(r["attack"]) if r["attack"] in attacks else 9,
        )

    return sorted(rows, key=key)


def fmt_resistance(rows: list[dict[str, Any]], recipe: dict[str, Any] | None) -> list[str]:
    import results_aegis as ra

    delta = 1.0 / N_TRAIN
    lines = [
        "| model | defense | epsilon (utility schedule: q = 32/8000, 500 steps) | epsilon (recipe schedule) | best token recovery | "
        "best presence F1 minus random | AEGIS goal met |",
        "|---|---|---|---|---|---|---|",
    ]
    for m in dict.fromkeys(r["model"] for r in rows):
        for d in dict.fromkeys(r["defense"] for r in rows if r["model"] == m):
            mine = [r for r in rows if r["model"] == m and r["defense"] == d]
            sigma = float(d.split("s=")[1]) if "s=" in d else None
            e1 = fmt_eps(eps_of(sigma, UTILITY_BATCH / N_TRAIN, UTILITY_STEPS, delta)) if sigma else "—"
            e2 = fmt_eps(eps_of(sigma, recipe["sample_rate"], recipe["steps"], delta)) if sigma and recipe else "—"
            tr = max(r.get("token_recovery", 0.0) for r in mine)
            pf = max(r["presence_f1"] - r.get("random_f1", 0.0) for r in mine)
            lines.append(
                f"| {m} | {d} | {e1} | {e2} | {tr:.3f} | {pf:+.3f} | {'yes' if ra.resists(rows, m, d) else 'no'} |"
            )
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--attacks", action="store_true", help="run the attack cells (else read runs/dp/attacks.json)")
    p.add_argument("--attack-models", default="minilm,hf-gpt2")
    p.add_argument(
        "--only-defenses",
        default="",
        help="with --attacks: run only these defense labels (comma list), merged into the cache",
    )
    p.add_argument(
        "--only-attacks", default="", help="with --attacks: run only these attacks (comma list), merged into the cache"
    )
    p.add_argument("--results", default=str(ROOT / "docs" / "results.md"))
    a = p.parse_args()
    torch.set_num_threads(1)
    urows = utility_rows()
    recipe = recipe_schedule()
    cache = RUNS / "attacks.json"
    if a.attacks:
        new = run_attacks(
            a.attack_models.split(","),
            recipe["noise_multiplier"],
            [d for d in a.only_defenses.split(",") if d],
            [x for x in a.only_attacks.split(",") if x],
        )
        old = json.loads(cache.read_text()) if cache.is_file() and (a.only_defenses or a.only_attacks) else []
        cache.write_text(json.dumps(merge(old, new), indent=1))
    rows = sort_cells(json.loads(cache.read_text()) if cache.is_file() else [])
    parts = [
        "## DP-SGD on Opacus, with an accountant (issue 17)",
        "",
        "Regenerated by `python scripts/results_dp.py` from the caches under `runs/dp` (commands in the script's docstring); "
        "never edit by hand. DP-SGD = `veil.defenses.dpsgd`: Poisson sampling, per-sample clipping (Opacus ghost clipping "
        "where Opacus' hooks cover every trainable parameter, else torch.func), Gaussian noise, virtual steps, Opacus' RDP "
        "accountant; epsilon at delta = 1/N (N = 8,000 training sentences).",
        "",
    ]
    parts += ["### Privacy-utility: MiniLM-L6 on SST-2", ""] + RECIPE_TEXT + [""] + fmt_utility(urows) + [""]
    parts += [CURVE_TEXT, "", "`head lr3e-2 B512 E5` (the config's recipe):", ""] + fmt_curve("curve") + [""]
    parts += (
        [
            "`head lr1e-2 B1024 E20` (the best validation row, 83.40 vs 83.20, run on test after the config was fixed; "
            "`--out runs/dp/curve_best`):",
            "",
        ]
        + fmt_curve("curve_best")
        + ["", VERDICT_TEXT, ""]
    )
    parts += (
        ["### How the recipe was chosen (validation split of the training pool, epsilon 8)", "", SCREEN_TEXT, ""]
        + fmt_screen()
        + [""]
    )
    bench = RUNS / "bench.json"
    if bench.is_file():
        b = json.loads(bench.read_text())
        parts += (
            [
                f"### Step time: veil's DP-SGD against Opacus (`python benchmarks/dp_step.py --repeats {b['repeats']} --json runs/dp/bench.json`)",
                "",
                BENCH_TEXT,
                "",
            ]
            + fmt_bench(b)
            + [""]
        )
    if rows:
        import results_aegis as ra

        parts += (
            [
                "### Attacks against DP-SGD on minilm and hf-gpt2, beside AEGIS (`python scripts/results_dp.py --attacks`)",
                "",
                ATTACK_TEXT,
                "",
            ]
            + ra.fmt_attacks(rows)
            + ["", "Worst case per defense, and the epsilon each noise level costs:", ""]
        )
        parts += fmt_resistance(rows, recipe) + ["", MATCH_TEXT, ""]
    parts += [SUPERSEDED_TEXT, ""]
    write_section("dp", "\n".join(parts), Path(a.results))
    print(f"wrote the DP-SGD section of {a.results}")


RECIPE_TEXT = [
    "`configs/dp_minilm_sst2.yaml` (see its comment) through veil's loop "
    "(`veil train configs/dp_minilm_sst2.yaml defense.target_epsilon=E --out runs/dp/minilm-epsE`): sigma from the "
    "accountant for the run's schedule (q = 512/8,000, 80 steps); the epsilon column is the accountant's after the "
    "epochs run. Test = GLUE's 872-sentence dev split, seed 0. Each veil epoch re-runs the frozen encoder over 8,000 "
    "sentences (7-12 minutes on this machine's contended core): a run marked 'stopped early' did not finish in the "
    "session (epsilon 8 ran its first epoch with the then-default noise seed 0, the rest with a secret seed after "
    "a resume). The 3-seed curve below comes from the same computation on cached encoder outputs (a slow test checks that the two give the same clipped "
    "update: `tests/test_dpsgd.py::test_the_cached_encoder_screen_computes_veils_dp_update`). Non-private reference: "
    "full fine-tuning 86.12 % (utility section, 3 seeds)."
]
CURVE_TEXT = (
    "The same recipe, 3 seeds, through `python scripts/screen_dp_minilm.py --out runs/dp/curve --test --variants "
    '"head lr3e-2 B512 E5" --epsilon 1 3 8 0 --seeds 0 1 2`: Opacus\' PrivacyEngine (ghost clipping, Poisson sampling, '
    "RDP) trains the classifier on the frozen encoder's cached outputs (dropout 0: the computation of the veil runs above, "
    "which re-run the frozen encoder every epoch), trained on all 8,000 sentences and scored on the test split after "
    "the recipe was fixed on validation:"
)
VERDICT_TEXT = (
    "**Goal (issue 17): >= 80 % test accuracy at epsilon 8 — not met with the 8,000 shipped sentences (met with GLUE's "
    "whole training set: next subsection): 79.74 ± 0.05 (3 seeds, cached encoder), 79.13 "
    "(veil's loop, seed 0).** The recipe's "
    "ceiling is its frozen encoder, not the noise: the same recipe with clipping and no noise reaches 79.13 ± 0.25, and "
    "epsilon 1 costs one point (78.67 ± 0.09). Validation overstates the test split by ~3.5 points (83.2 vs 79.7). "
    "Training MiniLM's last layer as well (`top1`, 1.8 M parameters, lr 1e-3) lost to the noise on validation "
    "(76.0 % vs 83.2 %); other learning rates, LoRA, or full DP fine-tuning (ghost clipping: 2.1-2.3x a plain "
    "step) were not screened on this machine's compute."
)
SCREEN_TEXT = (
    "`python scripts/screen_dp_minilm.py`: 1,000 held-out sentences of the training pool, training on the other 7,000, delta "
    "1/7,000, epsilon 8, Opacus' PrivacyEngine (ghost clipping, Poisson sampling) on MiniLM's cached last-layer inputs "
    "(dropout 0). `head` trains the classifier on the frozen mean-pooled encoder, `top1` the last layer too. Rows "
    "in run order; the `E5` head rows were added after the first four (a veil epoch is expensive); the other `top1` "
    "rows of the script's list were not run (compute)."
)
BENCH_TEXT = (
    "Every DP variant trains all of MiniLM but the two tables its adapter reads as slices and the unused pooler (Opacus' "
    "hooks give those no per-sample gradient); noise 1, clip 1. veil-ghost is veil's `dpsgd(mode=ghost)`, which runs "
    "Opacus' ghost-clipping hooks on the model; opacus-* are Opacus' own GradSampleModule + DPOptimizer(s). "
    "One contended CPU core: the ratios, not the seconds, are the result."
)
ATTACK_TEXT = (
    "`scripts/results_aegis.py`'s attack machinery (batch 4, 24 tokens, weights at init, no dropout; the same attacks, budgets "
    "and AEGIS goal), now on the fixed HF adapters (no module aliasing): every DP-SGD cell below is a measured attack "
    "on the full exported update, not a 'blocked: no gradient' artifact. The `head` / `top1` rows export what a DP recipe "
    "trains at the recipe's epsilon-8 noise: `head` = the classifier only, `top1` = MiniLM's last layer + the classifier."
)
MATCH_TEXT = (
    "Reading: undefended, the span attack rebuilds minilm's batch (token recovery 1.000) and hf-gpt2's (1.000) (AEGIS "
    "section); hf-gpt2 ties its token embedding to the LM head, so the presence attacks never apply to it. AEGIS meets "
    "its goal on minilm (AEGIS section: presence at random level, span blocked). DP-SGD meets "
    "the same goal already at noise multiplier 0.1, whose formal guarantee is void (epsilon in the thousands). "
    "These attacks fail against any Gaussian noise of that size (every vocabulary row looks present; the span search "
    "finds nothing), so their failure measures the attacks' weakness under noise, not privacy: at matched attack "
    "resistance, DP-SGD's epsilon says nothing, and only the epsilon column is a guarantee. The recipe rows export "
    "no embedding or lower-layer gradient at all, so the attacks that read those are blocked by what the recipe trains."
)
SUPERSEDED_TEXT = (
    "**Superseded figures.** The DP-SGD cells of the AEGIS section on minilm / hf-gpt2 ('blocked: the observation "
    "has no gradient'), its 'DP-SGD matching AEGIS' lines for those models, and the utility section's "
    "`dpsgd(noise_multiplier=0.1)` MiniLM row (50.92 %, the majority class) were produced while the HF adapters "
    "registered their handles as second module paths (issue 17): after one DP step only 4 of MiniLM's 105 "
    "parameters were still the optimiser's, and the exported update held 4 gradients. They are not valid; the "
    "figures in this section replace them."
)


if __name__ == "__main__":
    main()
