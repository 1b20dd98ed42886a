"""Regenerate the MJP section of docs/results.md (between `<!-- mjp:start -->` and `<!-- mjp:end -->`)
from runs it trains with veil's training API; finished runs in --runs-dir are reused, never retrained.

    python scripts/results_mjp.py --quick            # small budgets, 1 seed: a smoke reproduction
    python scripts/results_mjp.py                    # the full reproduction (hours on 2 CPU cores)
    python scripts/results_mjp.py --only accuracy consistency

Sections (the paper's analogues): accuracy with / without MJP, mean ± std over seeds (Table I/IV);
accuracy vs training gamma (Table II / V); accuracy vs test-time gamma (Fig. 4/5, PNG); window
size (Table VI); PCA explained variance of the position embeddings (Table XII).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from resultsdoc import write_section  # noqa: E402

SECTIONS = ("accuracy", "gamma", "consistency", "window", "pca", "overhead")

# (label, base overrides, full epochs, quick epochs, quick extra overrides)
SETTINGS: dict[str, tuple[str, list[str], int, int, list[str]]] = {
    "digits": (
        "ViT (vit-digits) on digits",
        ["model=vit-digits", "data=digits", "train.batch_size=64", "train.lr=0.003"],
        60,
        12,
        [],
    ),
    "lfw": (
        "ViT (width 64, patch 4) on LFW faces",
        ["model=vit-digits", "model.patch_size=4", "data=lfw", "data.size=32", "train.batch_size=32", "train.lr=0.002"],
        60,
        15,
        [],
    ),
    "sst2": (
        "MiniLM-L6 on SST-2",
        [
            "model=minilm",
            "data=sst2",
            "data.max_len=64",
            "train.batch_size=32",
            "train.lr=0.00005",
            "train.weight_decay=0.001",
        ],
        2,
        1,
        ["data.train_size=1000", "data.test_size=400"],
    ),
    "t4": (
        "Transformer4 on SST-2",
        [
            "model=transformer4",
            "data=sst2",
            "data.tokenizer=word",
            "data.max_len=64",
            "train.batch_size=32",
            "train.lr=0.0005",
            "train.weight_decay=0.001",
        ],
        8,
        3,
        ["data.train_size=3000", "data.test_size=400"],
    ),
}
VISION_GAMMA, TEXT_GAMMA = 0.1, 0.5


def mjp_overrides(setting: str, gamma: float | None, variant: str = "mjp", window: int | None = None) -> list[str]:
    if gamma is None:
        return []
    out = ["defense=mjp", f"defense.gamma={gamma}", f"defense.variant={variant}"]
    if setting in ("sst2", "t4"):
        out += [f"defense.window={window or 32}", "defense.aux=none"]
    elif variant != "mjp":
        out += ["defense.aux=none"]
    return out


class Runner:
    def __init__(self, runs_dir: Path, quick: bool) -> None:
        self.dir = runs_dir / ("quick" if quick else "full")
        self.quick = quick

    def run(
        self, setting: str, seed: int, gamma: float | None = None, variant: str = "mjp", window: int | None = None
    ) -> tuple[Path, dict[str, Any]]:
        """Train (or reuse) one run; returns its folder and summary."""
        from veil.config import load_config
        from veil.training.loop import train

        _, base, full_ep, quick_ep, quick_extra = SETTINGS[setting]
        ov = (
            base
            + (quick_extra if self.quick else [])
            + [f"train.epochs={quick_ep if self.quick else full_ep}", f"train.seed={seed}"]
        )
        ov += mjp_overrides(setting, gamma, variant, window)
        tag = "none" if gamma is None else f"{variant}-g{gamma:g}" + (f"-w{window}" if window else "")
        out = self.dir / setting / f"{tag}-s{seed}"
        print(f"[mjp] {out.relative_to(self.dir)}", flush=True)
        return out, train(load_config(None, ov), out, progress=False)


def mean_std(xs: list[float]) -> str:
    xs = [100 * x for x in xs]
    return f"{statistics.mean(xs):.2f} ± {statistics.stdev(xs):.2f}" if len(xs) > 1 else f"{xs[0]:.2f}"


def section_accuracy(r: Runner, seeds: list[int]) -> list[str]:
    lines = [
        "### Accuracy with and without MJP",
        "",
        f"Test accuracy (%), mean ± std over seeds {seeds}. MJP: images gamma {VISION_GAMMA}, block selection, DAL "
        f"(lambda 0.01); text gamma {TEXT_GAMMA}, window 32, no auxiliary loss. Goal: MJP within 1 point of (or above) the "
        "undefended model.",
        "",
        "| setting | undefended | MJP | MJP - undefended | within 1 point |",
        "|---|---|---|---|---|",
    ]
    note = "MiniLM-L6 on SST-2 with and without MJP: see *Utility of MJP and AEGIS* (`scripts/results_utility.py`)."
    for s in ("digits", "lfw"):  # MiniLM on SST-2: the utility section (runs shared with AEGIS)
        g = VISION_GAMMA
        none = [r.run(s, seed)[1]["test_accuracy"] for seed in seeds]
        mjp = [r.run(s, seed, g)[1]["test_accuracy"] for seed in seeds]
        d = 100 * (statistics.mean(mjp) - statistics.mean(none))
        lines.append(
            f"| {SETTINGS[s][0]} | {mean_std(none)} | {mean_std(mjp)} | {d:+.2f} | {'yes' if d >= -1 else 'no'} |"
        )
    return lines + ["", note]


def section_gamma(r: Runner) -> list[str]:
    lines = [
        "### Accuracy vs training gamma (Table II / V analogue)",
        "",
        "Seed 0; gamma 0 is the undefended model.",
        "",
    ]
    vg = [0.03, 0.1, 0.2, 0.3] if not r.quick else [0.1, 0.3]
    tg = [0.1, 0.3, 0.5, 0.7] if not r.quick else [0.3, 0.5]
    for s, gammas, variants in (("digits", vg, ["mjp"]), ("t4", tg, ["shuffle", "mjp"])):
        lines += [
            f"**{SETTINGS[s][0]}**",
            "",
            "| method | " + " | ".join(["0"] + [f"{g:g}" for g in gammas]) + " |",
            "|---" * (len(gammas) + 2) + "|",
        ]
        base = 100 * r.run(s, 0)[1]["test_accuracy"]
        for v in variants:
            accs = [100 * r.run(s, 0, g, v)[1]["test_accuracy"] for g in gammas]
            lines.append(f"| {v} | {base:.2f} | " + " | ".join(f"{a:.2f}" for a in accs) + " |")
        lines.append("")
    return lines


def section_consistency(r: Runner, seeds: list[int], fig_dir: Path) -> list[str]:
    from veil.commands.eval import evaluate_shuffled

    test_gammas = [0.0, 0.1, 0.2, 0.27, 0.4, 0.5]
    curves: dict[str, list[float]] = {}
    for name, gamma in (
        ("undefended", None),
        (f"MJP (train gamma {VISION_GAMMA})", VISION_GAMMA),
        ("MJP (train gamma 0.3)", 0.3),
    ):
        per_seed = []
        for seed in seeds:
            path, _ = r.run("digits", seed, gamma)
            per_seed.append([evaluate_shuffled(path, tg, seed=seed)["test_accuracy"] for tg in test_gammas])
        curves[name] = [100 * statistics.mean(col) for col in zip(*per_seed)]
    _plot(test_gammas, curves, fig_dir / "mjp_consistency_digits.png", "ViT on digits: accuracy vs test-time shuffle")
    i = test_gammas.index(0.27)
    drop = {k: v[0] - v[i] for k, v in curves.items()}
    base_drop, mjp_drop = drop["undefended"], drop[f"MJP (train gamma {VISION_GAMMA})"]
    ok = mjp_drop <= 0.5 * base_drop
    lines = [
        "### Consistency: accuracy vs test-time gamma (Fig. 4 analogue)",
        "",
        f"ViT on digits, mean over seeds {seeds}; test images shuffled block-wise at each ratio (MJP models put E_unk at the "
        "shuffled slots). ![consistency](figures/mjp_consistency_digits.png)",
        "",
        "| model | " + " | ".join(f"{g:g}" for g in test_gammas) + " | drop at 0.27 |",
        "|---" * (len(test_gammas) + 2) + "|",
    ]
    lines += [f"| {k} | " + " | ".join(f"{a:.2f}" for a in v) + f" | {drop[k]:.2f} |" for k, v in curves.items()]
    lines += [
        "",
        f"Goal (MJP loses at most half the undefended drop at 0.27): {'met' if ok else 'not met'} "
        f"({mjp_drop:.2f} vs {base_drop:.2f} points).",
        "",
    ]
    return lines


def _plot(xs: list[float], curves: dict[str, list[float]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for k, v in curves.items():
        ax.plot(xs, v, marker="o", label=k)
    ax.set(xlabel="test-time shuffle ratio gamma", ylabel="test accuracy (%)", title=title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def section_window(r: Runner) -> list[str]:
    windows = [4, 8, 16, 32] if not r.quick else [8, 32]
    lines = [
        "### Window size (Table VI analogue)",
        "",
        f"{SETTINGS['t4'][0]}, gamma {TEXT_GAMMA}, seed 0.",
        "",
        "| method | " + " | ".join(str(w) for w in windows) + " |",
        "|---" * (len(windows) + 1) + "|",
    ]
    for v in ("shuffle", "mjp"):
        accs = [100 * r.run("t4", 0, TEXT_GAMMA, v, None if w == 32 else w)[1]["test_accuracy"] for w in windows]
        lines.append(f"| {v} | " + " | ".join(f"{a:.2f}" for a in accs) + " |")
    return lines + [""]


def section_pca(r: Runner) -> list[str]:
    from veil.analysis.pe import analyze_model_pe
    from veil.build import load_run

    dims = list(range(1, 11))
    lines = [
        "### PCA of the position embeddings (Table XII analogue)",
        "",
        "Cumulative explained variance (%) by projected dimension, seed 0.",
        "",
        "| model | " + " | ".join(str(d) for d in dims) + " |",
        "|---" * (len(dims) + 1) + "|",
    ]
    for s, g in (("digits", VISION_GAMMA), ("t4", TEXT_GAMMA)):
        for gamma in (None, g):
            path, _ = r.run(s, 0, gamma)
            _, model, data, _ = load_run(path)
            rows = int(data.train["input_ids"].shape[1]) if model.modality == "text" else None
            res = analyze_model_pe(model, path / "analysis" / "pe", plots=True, rows=rows)
            ev = res["explained_variance_percent"]
            name = f"{SETTINGS[s][0]}{' + MJP' if gamma else ''}"
            lines.append(f"| {name} | " + " | ".join(f"{ev[str(d)]:.2f}" for d in dims) + " |")
    return lines + [""]


def section_overhead(quick: bool) -> list[str]:
    """benchmarks/mjp_overhead.py per preset, interleaved in one run (paper settings)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from mjp_overhead import PRESETS, bench

    reps = 10 if quick else 40
    lines = [
        "### Training-step overhead of MJP (goal: <= 1.05 x undefended)",
        "",
        f"`benchmarks/mjp_overhead.py`: median of {reps} interleaved steps per preset (forward, aux loss, backward, fused AdamW), "
        "1 torch thread, each preset at its training batch (vit-digits 64 as in configs/vit_digits.yaml, others 32; text 64 "
        "tokens). MJP: images gamma 0.03, block selection, DAL; text gamma 0.5, window 32. Wall time counts the waits of a "
        "shared machine; thread CPU time is the step's own compute (the two agree when the machine is idle).",
        "",
        "| preset | batch | undefended ms | MJP ms | wall ratio | CPU ratio | goal (CPU ratio <= 1.05) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, spec in PRESETS.items():
        b = bench(name, reps, spec.get("batch", 32), 64, None)
        lines.append(
            f"| {name} | {b['batch']} | {b['undefended_cpu_ms']:.2f} | {b['mjp_cpu_ms']:.2f} | {b['ratio']:.3f} | {b['cpu_ratio']:.3f} | "
            f"{'met' if b['cpu_ratio'] <= 1.05 else 'not met'} |"
        )
    return lines + [""]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small budgets and one seed (a smoke reproduction)")
    ap.add_argument(
        "--runs-dir", type=Path, default=ROOT / "runs" / "mjp", help="where runs live; finished ones are reused"
    )
    ap.add_argument("--doc", type=Path, default=ROOT / "docs" / "results.md")
    ap.add_argument("--only", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    ap.add_argument("--seeds", type=int, nargs="+", default=None, help="default: 0 1 2 (quick: 0)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest on a shared 2-core machine)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    seeds = args.seeds or ([0] if args.quick else [0, 1, 2])
    r = Runner(args.runs_dir, args.quick)
    mode = "quick (reduced budgets: a smoke run, not the reproduction)" if args.quick else "full"
    body = [
        "## MJP (Masked Jigsaw Puzzle)",
        "",
        f"Generated by `python scripts/results_mjp.py{' --quick' if args.quick else ''}` — mode: {mode}. "
        "Never edit by hand.",
        "",
    ]
    makers = {
        "accuracy": lambda: section_accuracy(r, seeds),
        "gamma": lambda: section_gamma(r),
        "consistency": lambda: section_consistency(r, seeds, args.doc.parent / "figures"),
        "window": lambda: section_window(r),
        "pca": lambda: section_pca(r),
        "overhead": lambda: section_overhead(args.quick),
    }
    cache = r.dir / "sections"
    cache.mkdir(parents=True, exist_ok=True)
    for name in SECTIONS:  # sections not asked for are kept from their last generation
        if name in args.only:
            (cache / f"{name}.md").write_text("\n".join(makers[name]()) + "\n")
        if (cache / f"{name}.md").is_file():
            body += (cache / f"{name}.md").read_text().splitlines() + [""]
        elif not args.quick and (r.dir.parent / "quick" / "sections" / f"{name}.md").is_file():  # not yet run in full
            lines = (r.dir.parent / "quick" / "sections" / f"{name}.md").read_text().splitlines()
            body += (
                lines[:1]
                + ["", "*From the quick run (reduced budgets, seed 0): not yet regenerated in full mode.*"]
                + lines[1:]
                + [""]
            )
    write_section("mjp", "\n".join(body), args.doc)
    print(f"wrote the MJP section of {args.doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
