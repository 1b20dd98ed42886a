"""DP-SGD on MiniLM-L6 with GLUE's whole SST-2 training set (issue 17's 80 % line): the validation
screen that chose `configs/dp_minilm_sst2_glue.yaml`, the test curve over epsilon and seeds, and the
end-to-end `veil train` runs, into docs/results.md between `<!-- dp-glue:start -->` / `<!-- dp-glue:end -->`.

    python scripts/results_dp_glue.py --data ../shared/data/sst2 screen   # validation: 5,000 rows held out of the pool
    python scripts/results_dp_glue.py --data ../shared/data/sst2 curve    # test: epsilon 1, 3, 8, no noise x seeds 0-2
    python scripts/results_dp_glue.py --data ../shared/data/sst2 attack   # head-embedding on batch-1 updates of the recipe
    for e in 1 3 8; do veil train configs/dp_minilm_sst2_glue.yaml defense.target_epsilon=$e --out runs/dp/glue-eps$e; done
    python scripts/results_dp_glue.py write

Every run is veil's own loop (`veil.training.loop.train`: Poisson batches, `dpsgd` with Opacus ghost
clipping, the RDP accountant). The screen and the curve share one pass of the frozen encoder over the
data (`veil.training.frozen.encoder_features`, stored in runs/dp/glue/features.safetensors) and hand
veil's loop the features as the training split: what `train.frozen_features: true` does inside each
`veil train` run, which recomputes them (a test checks the two train the same head). Their noise is
seeded (`seed` = 1000 + run seed) so the tables regenerate; the `veil train` runs keep the secret
default (seed: null).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import sys
from pathlib import Path
from statistics import mean, pstdev
from typing import Any

import torch
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from resultsdoc import write_section  # noqa: E402

from veil.build import build_data, build_run  # noqa: E402
from veil.config import from_dict, load_config  # noqa: E402
from veil.data import DataSplits  # noqa: E402
from veil.models.base import FEATURES  # noqa: E402
from veil.training.frozen import encoder_features  # noqa: E402
from veil.training.loop import train  # noqa: E402

CONFIG = ROOT / "configs" / "dp_minilm_sst2_glue.yaml"
RUNS = ROOT / "runs" / "dp"
HELD_OUT, SPLIT_SEED = 5000, 10_000
#: the screened variants, in the order they were tried: (lr, logical batch, epochs)
VARIANTS = [(3e-2, 512, 5), (3e-2, 2048, 5), (1e-1, 2048, 10), (3e-2, 2048, 10)]
EPSILONS = (1.0, 3.0, 8.0, None)  # None: clipping without noise
SEEDS = (0, 1, 2)


def recipe(data: str | None) -> dict[str, Any]:
    raw = load_config(CONFIG).to_dict()
    if data is not None:
        raw["data"]["path"] = data
    raw["train"]["frozen_features"] = False  # the splits below already hold the features
    raw["train"]["threads"] = 1  # one thread: a linear head gains nothing from two, and the machine is shared
    return raw


def features(raw: dict[str, Any]) -> tuple[DataSplits, dict[str, torch.Tensor]]:
    """The shipped text splits and the frozen encoder's features of both (computed once, cached)."""
    cfg = from_dict({k: v for k, v in raw.items() if k != "defense"})
    data = build_data(cfg)
    cache = RUNS / "glue" / "features.safetensors"
    if cache.is_file():
        return data, load_file(str(cache))
    model, _, _ = build_run(cfg, data)
    out = {s: encoder_features(model, getattr(data, s), 256, torch.device("cpu")) for s in ("train", "test")}
    cache.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in out.items()}, str(cache))
    return data, out


def run(
    raw: dict[str, Any],
    data: DataSplits,
    train_idx: torch.Tensor | None,
    eval_split: str,
    feats: dict[str, torch.Tensor],
    lr: float,
    batch: int,
    epochs: int,
    eps: float | None,
    seed: int,
    out: Path,
) -> dict[str, Any]:
    """One veil training run of the head on the cached features; the summary plus its settings."""
    cfg_raw = copy.deepcopy(raw)
    cfg_raw["train"].update(lr=lr, batch_size=batch, epochs=epochs, seed=seed)
    dp = cfg_raw["defense"][0]
    dp.pop("target_epsilon", None)
    dp.update({"target_epsilon": eps} if eps is not None else {"noise_multiplier": 0.0})
    dp["seed"] = 1000 + seed
    cfg = from_dict(cfg_raw)
    labels = data.train["labels"]
    idx = torch.arange(len(labels)) if train_idx is None else train_idx
    if eval_split == "validation":
        rest = torch.ones(len(labels), dtype=torch.bool)
        rest[idx] = False
        test = {FEATURES: feats["train"][rest], "labels": labels[rest]}
    else:
        test = {FEATURES: feats["test"], "labels": data.test["labels"]}
    split = dataclasses.replace(data, train={FEATURES: feats["train"][idx], "labels": labels[idx]}, test=test)
    model, _, defenses = build_run(cfg, data)
    summary = train(cfg, out, model=model, data=split, defenses=defenses, progress=False)
    row = {
        "lr": lr,
        "batch": batch,
        "epochs": epochs,
        "target_epsilon": eps,
        "seed": seed,
        "split": eval_split,
        "n_train": len(idx),
        "accuracy": summary["test_accuracy"],
        "privacy": summary["privacy"],
    }
    print(json.dumps(row), flush=True)
    return row


def screen(raw: dict[str, Any]) -> None:
    data, feats = features(raw)
    perm = torch.randperm(len(data.train["labels"]), generator=torch.Generator().manual_seed(SPLIT_SEED))
    rows = [
        run(
            raw,
            data,
            perm[HELD_OUT:],
            "validation",
            feats,
            lr,
            b,
            e,
            8.0,
            0,
            RUNS / "glue-screen" / f"lr{lr:g}-B{b}-E{e}",
        )
        for lr, b, e in VARIANTS
    ]
    (RUNS / "glue" / "screen.json").write_text(json.dumps(rows, indent=1))


def ATTACKED(sigma: float) -> list[tuple[str, float, dict[str, Any] | None]]:
    """(label, noise multiplier, defense spec; None = DP-SGD on the classifier only) of each attacked update."""
    full = {"name": "dpsgd", "clip": 1.0, "seed": 7}
    return [
        ("head only, no noise", 0.0, None),
        ("head only, the recipe's epsilon-8 noise", sigma, None),
        ("head only, noise multiplier 0.1", 0.1, None),
        ("whole model, DP-SGD noise multiplier 0.1", 0.1, {**full, "noise_multiplier": 0.1}),
        ("whole model, DP-SGD noise multiplier 1", 1.0, {**full, "noise_multiplier": 1.0}),
        (
            "whole model, AEGIS (configs/aegis_minilm_sst2.yaml)",
            float("nan"),
            {"name": "aegis", "freeze_attention": True, "embed_noise": 3.0, "mlp_noise": 1.0, "seed": 0},
        ),
    ]


def attack(raw: dict[str, Any], samples: int = 32) -> None:
    """head-embedding on batch-1 updates of test sentences (pool = the 872 test sentences): head-only
    updates without noise, at the recipe's epsilon-8 sigma and at sigma 0.1 (a void epsilon); whole-model
    updates under DP-SGD and under AEGIS (which exports the classifier's gradient untouched)."""
    from veil.attacks import create_attack
    from veil.attacks.base import Knowledge, observe
    from veil.defenses import create_defense
    from veil.defenses.dpsgd import DPSGD

    data, feats = features(raw)
    cfg = from_dict({**raw, "defense": []})
    model, _, _ = build_run(cfg, data)
    sigma = json.loads((RUNS / "glue" / "curve.json").read_text())
    sigma = next(r["privacy"]["noise_multiplier"] for r in sigma if r["target_epsilon"] == 8.0)
    pool = {k: v for k, v in data.test.items() if k != "labels"}
    know = Knowledge(batch_size=1, aux_data={"candidates": pool, "candidate_features": feats["test"]})
    rows = []
    for label, s, spec in ATTACKED(sigma):
        d = create_defense(**spec) if spec else DPSGD(clip=1.0, noise_multiplier=s, trainable="classifier", seed=7)
        d.attach(model)
        hits, cos = 0, []
        for i in range(samples):
            batch = {k: v[i : i + 1] for k, v in data.test.items()}
            rec = create_attack("head-embedding").reconstruct(observe(model, batch, [d]), know)
            hits += rec.token_ids[0] == batch["input_ids"][0][batch["attention_mask"][0].bool()].tolist()
            cos.append(rec.stats["cosine"])
        d.detach()
        rows.append(
            {
                "setting": label,
                "sigma": s,
                "samples": samples,
                "pool": len(feats["test"]),
                "identified": hits / samples,
                "best_cosine": mean(cos),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    (RUNS / "glue" / "attack.json").write_text(json.dumps(rows, indent=1))


def curve(raw: dict[str, Any]) -> None:
    data, feats = features(raw)
    t = raw["train"]
    rows = [
        run(
            raw,
            data,
            None,
            "test",
            feats,
            t["lr"],
            t["batch_size"],
            t["epochs"],
            eps,
            seed,
            RUNS / "glue-curve" / f"eps{eps or 'none'}-seed{seed}",
        )
        for eps in EPSILONS
        for seed in SEEDS
    ]
    (RUNS / "glue" / "curve.json").write_text(json.dumps(rows, indent=1))


# ---- the section -----------------------------------------------------------------------------------
def fmt_eps(e: Any) -> str:
    return "inf" if e in (None, "inf") or not math.isfinite(float(e)) else f"{float(e):.3g}"


def fmt_screen(rows: list[dict[str, Any]]) -> list[str]:
    best = max(r["accuracy"] for r in rows)
    lines = [
        "| lr | logical batch | epochs (steps) | noise multiplier | epsilon (delta) | validation accuracy (%) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        p = r["privacy"]
        mark = " **(best)**" if r["accuracy"] == best else ""
        lines.append(
            f"| {r['lr']:g} | {r['batch']} | {r['epochs']} ({p['steps']}) | {p['noise_multiplier']:.3f} | "
            f"{fmt_eps(p['epsilon'])} ({p['delta']:.3g}) | {100 * r['accuracy']:.2f}{mark} |"
        )
    return lines


def fmt_curve(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| target epsilon | epsilon spent (delta) | noise multiplier | seeds | test accuracy (%) |",
        "|---|---|---|---|---|",
    ]
    for eps in EPSILONS:
        rs = [r for r in rows if r["target_epsilon"] == eps]
        if not rs:
            continue
        acc = [100 * r["accuracy"] for r in rs]
        p = rs[0]["privacy"]
        lines.append(
            f"| {'none (clipping, no noise)' if eps is None else f'{eps:g}'} | {fmt_eps(p['epsilon'])} ({p['delta']:.3g}) | "
            f"{p['noise_multiplier']:.3f} | {len(rs)} | {mean(acc):.2f} ± {pstdev(acc):.2f} |"
        )
    return lines


def fmt_cli() -> list[str]:
    lines = ["| command | epsilon spent (delta) | steps | train seconds | test accuracy (%) |", "|---|---|---|---|---|"]
    for e in (1, 3, 8):
        f = RUNS / f"glue-eps{e}" / "summary.json"
        if f.is_file():
            s = json.loads(f.read_text())
            p = s["privacy"]
            lines.append(
                f"| `veil train configs/dp_minilm_sst2_glue.yaml defense.target_epsilon={e} --out runs/dp/glue-eps{e}` | "
                f"{fmt_eps(p['epsilon'])} ({p['delta']:.3g}) | {s['steps']} | {s['train_seconds']:.0f} | {100 * s['test_accuracy']:.2f} |"
            )
    return lines


def fmt_attack() -> list[str]:
    f = RUNS / "glue" / "attack.json"
    if not f.is_file():
        return ["(not run: `attack`)"]
    lines = [
        "| update | noise multiplier | updates attacked | pool | sentences identified | mean best cosine |",
        "|---|---|---|---|---|---|",
    ]
    for r in json.loads(f.read_text()):
        noise = "—" if math.isnan(r["sigma"]) else f"{r['sigma']:.3g}"
        lines.append(
            f"| {r['setting']} | {noise} | {r['samples']} | {r['pool']} | {100 * r['identified']:.1f} % | {r['best_cosine']:.3f} |"
        )
    return lines


def write(results: Path) -> None:
    screen_rows = json.loads((RUNS / "glue" / "screen.json").read_text())
    curve_rows = json.loads((RUNS / "glue" / "curve.json").read_text())
    eight = [100 * r["accuracy"] for r in curve_rows if r["target_epsilon"] == 8.0]
    cli = (
        json.loads((RUNS / "glue-eps8" / "summary.json").read_text())
        if (RUNS / "glue-eps8" / "summary.json").is_file()
        else None
    )
    met = min(eight) >= 80 and (cli is None or cli["test_accuracy"] >= 0.80)
    parts = [
        "### The recipe that meets the goal: GLUE's whole SST-2 training set (`configs/dp_minilm_sst2_glue.yaml`)",
        "",
        "Regenerated by `python scripts/results_dp_glue.py` (commands in its docstring). What capped the recipe above is "
        "the data, not the noise: on 8,000 sentences the head on the frozen encoder reaches ~79 % even without noise. "
        "This recipe reads GLUE's SST-2 training set from a path (60,614 rows, phrases included; veil ships 8,000 of them), "
        "trains the classifier on the frozen mean-pooled MiniLM (`trainable: classifier`, `train.frozen_features: true`: "
        "the encoder's output is computed once), 64 tokens, epsilon at delta = 1/60,614. Test = the same 872-sentence "
        "GLUE dev split.",
        "",
        "**End to end through the CLI** (seed 0, secret noise seed; each run computes the frozen features itself, one "
        "forward of MiniLM over the 60,614 rows, ~10-20 minutes on this shared 2-core machine; train seconds exclude "
        "it and are indicative only):",
        "",
    ]
    parts += fmt_cli() + [
        "",
        "**Test curve** (`curve`: the config's recipe, seeded noise, 3 seeds; trained on all 60,614 rows):",
        "",
    ]
    parts += fmt_curve(curve_rows) + [""]
    verdict = "met" if met else "NOT met"
    parts += [
        f"**Goal (issue 17): >= 80 % test accuracy at epsilon 8 — {verdict}: {mean(eight):.2f} ± {pstdev(eight):.2f} "
        f"(3 seeds, min {min(eight):.2f})" + (f"; the CLI run {100 * cli['test_accuracy']:.2f}" if cli else "") + ".** "
        "Epsilon 8 costs nothing measurable against clipping without noise (the last row), and epsilon 1 about half a "
        "point: with N = 60,614 and 770 trainable parameters the noise is small beside the signal. The ceiling is the "
        "frozen encoder's: non-private full fine-tuning reaches 86.12 % (utility section); DP fine-tuning of the encoder "
        "itself (top layers, LoRA) was not screened here.",
        "",
        "**What this recipe exports, and the attacker it faces.** Only the classifier's gradient leaves the client, so "
        "the token attacks (the `head` rows of the attack table above) read nothing: blocked by what is trained, not by "
        "the noise. The attacker that knows this reads the sentence's frozen MiniLM embedding off that gradient "
        "(`head-embedding`: for a batch of one, dL/dW = (p - y) hᵀ and dL/db = p - y give h exactly) and matches it, with "
        "the same frozen model, against a pool of candidate sentences that holds the private one (an attribution / "
        "membership setting: a strong assumption, the worst case). `python scripts/results_dp_glue.py attack`: batch-1 "
        "updates of test sentences on MiniLM as loaded (pretrained encoder, classifier at init), DP clip 1, pool = the "
        "872 test sentences:",
        "",
    ]
    parts += fmt_attack() + [
        "",
        "Without noise a head-only update gives its sentence away (every one identified, cosine 1.0); at the recipe's "
        "epsilon-8 noise none is. At noise multiplier 0.1 (epsilon in the thousands) most still are, in head-only and in "
        "whole-model updates: the level at which the token attacks of the table above found nothing, so there the "
        "attacks were weak, not the updates private. **AEGIS exports the classifier's gradient untouched, so this "
        "attacker identifies every sentence of an AEGIS update (cosine 1.0)**: AEGIS closes the token channels it names, "
        "not the head, and its 'goal met' verdict in the AEGIS section holds only for the attacks run there. The "
        "audit engine grants the pool (the test split) to an attack that asks for it: `veil attack RUN --attack "
        "head-embedding` and any scenario listing it (the quickstart does). "
        "What bounds this attacker, and any other, is DP's guarantee: epsilon at delta = 1/N per training sentence.",
        "",
        f"**How the recipe was chosen** (`screen`): {HELD_OUT:,} rows held out of the training pool (permutation seeded "
        f"{SPLIT_SEED:,}), training on the other {screen_rows[0]['n_train']:,}, epsilon 8 at "
        "delta = 1/N of that run; the best validation row is the config's recipe. The pool holds SST-2 phrases, so "
        "held-out rows can be phrases of a training sentence: validation overstates test (as it does above).",
        "",
    ]
    parts += fmt_screen(screen_rows)
    write_section("dp-glue", "\n".join(parts), results)
    print(f"wrote the dp-glue section of {results}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=("screen", "curve", "attack", "write"))
    p.add_argument(
        "--data", default=None, help="folder with SST-2's train.tsv and test.tsv (default: the config's path)"
    )
    p.add_argument("--results", default=str(ROOT / "docs" / "results.md"))
    a = p.parse_args()
    if a.what == "write":
        write(Path(a.results))
    else:
        {"screen": screen, "curve": curve, "attack": attack}[a.what](recipe(a.data))


if __name__ == "__main__":
    main()
