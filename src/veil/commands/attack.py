"""`veil attack (RUN_DIR | CONFIG) --attack NAME [--batch-size B] [--samples N] [key=value ...] --out OUT`

Audits one model: for each of N private batches of the test split, run one client step under the
run's defenses (`observe`), hand the server's view to the attack, and score the reconstruction
against the private batch. `key=value` overrides the config (e.g. `defense=mjp gamma=0.5`);
`attack.KEY=VALUE` sets an attack option (e.g. `attack.iterations=500`), except
`attack.device=auto|cpu|cuda`, where the attack phase runs (the client's step, the attack; default
auto: CUDA when present; the numbers on the CPU do not depend on it). `train.threads=N` sets
torch's CPU threads as for `veil train` (0, the default: the cores the machine can give now, or
OMP_NUM_THREADS when set).

`--reference original|shuffled` picks what an image/text reconstruction is scored against: the
client's input (MJP setting (a) undefended, (c) defended) or the input as the shuffling defense
reordered it (setting (b)). Writes OUT/summary.json (`attacks.<name>.<metric>`, the mean over
samples), OUT/<name>.png (images: originals above reconstructions) or OUT/<name>.md (text:
aligned tokens, wrong ones struck through).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from veil.commands import subcommand
from veil.config import RunConfig, load_config, parse_value
from veil.errors import VeilError

if TYPE_CHECKING:  # torch and the attacks load when an attack runs, not for `veil --help`
    from torch import Tensor

    from veil.models.base import VeilModel

REFERENCES = ("original", "shuffled")  # = veil.attacks.harness.REFERENCES (tests/test_cli_fast.py checks)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = subcommand(sub, "attack", "run a privacy attack on one client update and score it", __doc__, run)
    p.add_argument("source", help="run folder (its finished model) or YAML config (weights at init)")
    p.add_argument("overrides", nargs="*", help="config key=value overrides; attack.KEY=VALUE for attack options")
    p.add_argument(
        "--attack", required=True, help="attack name (see `veil list`; `veil list --details NAME` for its options)"
    )
    p.add_argument("--batch-size", type=int, default=1, help="private batch size of the attacked update (default 1)")
    p.add_argument("--samples", type=int, default=4, help="number of attacked updates, averaged (default 4)")
    p.add_argument(
        "--reference", choices=REFERENCES, default="original", help="score against the original or the shuffled input"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the sample draw and the attack")
    p.add_argument(
        "--checkpoint",
        default=None,
        metavar="last|STEP|init",
        help="which weights of a run folder to attack when it has no finished model (default: the finished model)",
    )
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--quiet", action="store_true", help="no progress bar or table")
    p.__class__ = _KeyValueParser  # key=value may also follow the options


class _KeyValueParser(argparse.ArgumentParser):
    """Collects `key=value` words that argparse leaves over after the options into `overrides`."""

    def parse_known_args(self, args=None, namespace=None):  # noqa: ANN001, ANN201 - argparse's signature
        ns, extra = super().parse_known_args(args, namespace)
        kv = [a for a in extra if "=" in a and not a.startswith("-")]
        ns.overrides = list(getattr(ns, "overrides", None) or []) + kv
        return ns, [a for a in extra if a not in kv]


def run(args: argparse.Namespace) -> int:
    from veil.attacks.options import check_device, check_listed  # torch-free: `veil --help` loads no attack code
    from veil.commands.catalog import load as load_catalog

    cfg_over, attack_over = split_overrides(args.overrides)
    device = check_device(attack_over.pop("device", "auto"))  # the attack phase's, not an attack option
    # the attack's name and options, checked against the catalog before torch loads: a typo fails at once
    attacks = load_catalog()["kinds"]["attacks"]
    check_listed(args.attack, attack_over, attacks)
    most = attacks[args.attack].get("max_batch")  # the batch the attack cannot model fails before torch loads
    if most and args.batch_size > most[0]:
        raise VeilError(
            f"not applicable: {args.attack} needs a private batch of at most {most[0]} ({most[1]}); got {args.batch_size}"
        )
    model, data, defenses, cfg, weights = load_target(args.source, cfg_over, args.checkpoint)
    from veil.runtime import use_threads  # as `veil train`: 0 is what the machine can give now

    use_threads(cfg.train.threads)
    summary = attack_run(
        model,
        data,
        defenses,
        args.attack,
        attack_over,
        batch_size=args.batch_size,
        samples=args.samples,
        reference=args.reference,
        seed=args.seed,
        out=Path(args.out),
        progress=not args.quiet,
        config=cfg.to_dict(),
        weights=weights,
        device=device,
    )
    if not args.quiet:
        print(format_table(args.attack, summary["attacks"][args.attack]))
        print(f"weights: {weights['checkpoint']} (step {weights['step']}) from the {weights['source']}")
    return 0


# ---- inputs ------------------------------------------------------------------------------------
def split_overrides(items: list[str]) -> tuple[list[str], dict[str, Any]]:
    """`attack.KEY=VALUE` -> attack settings; everything else is a config override."""
    config, attack = [], {}
    for item in items:
        key, sep, value = item.partition("=")
        if sep and key.startswith("attack."):
            attack[key[len("attack.") :]] = parse_value(value)
        else:
            config.append(item)
    return config, attack


def load_target(
    source: str, overrides: list[str], checkpoint: str | None = None
) -> tuple[VeilModel, Any, list, RunConfig, dict[str, Any]]:
    """A run folder gives its finished model (or the weights `checkpoint` names: last | STEP |
    init); a config gives the model at its seeded init. Also returns what was read
    ({checkpoint, step, finished}, for summary.json)."""
    from veil.build import build_run, open_run

    path = Path(source)
    if not path.exists():
        raise VeilError(f"'{source}' does not exist; give a run folder written by `veil train` or a YAML config")
    if path.is_dir():
        cfg, model, data, defenses, weights = open_run(path, overrides, checkpoint)
        return model, data, defenses, cfg, {"source": "run folder", **weights.record()}
    if checkpoint is not None and str(checkpoint).strip().lower() not in ("init", "0"):
        raise VeilError(
            f"--checkpoint {checkpoint} needs a run folder; '{source}' is a config, whose model is at its seeded init"
        )
    cfg = load_config(source, overrides)
    model, data, defenses = build_run(cfg)
    return model, data, defenses, cfg, {"source": "config", "checkpoint": "init", "step": 0, "finished": False}


# ---- the whole audit -------------------------------------------------------------------------
def attack_run(
    model: VeilModel,
    data: Any,
    defenses: list,
    name: str,
    settings: dict[str, Any],
    *,
    batch_size: int = 1,
    samples: int = 4,
    reference: str = "original",
    seed: int = 0,
    out: Path | None = None,
    progress: bool = False,
    config: dict | None = None,
    weights: dict[str, Any] | None = None,
    device: str = "auto",
) -> dict[str, Any]:
    """Attack `samples` private test batches and write OUT/summary.json plus the picture;
    `weights` (which weights were attacked: checkpoint, step) goes into each run's entry;
    `device`: where the attack phase runs (`veil.attacks.harness.attack_device`)."""
    from veil.attacks import create_attack
    from veil.attacks.base import attack_progress
    from veil.attacks.harness import attack_device, attack_once, mean_metrics, private_batches, score, update_seed

    if reference not in REFERENCES:
        raise VeilError(f"reference must be one of {', '.join(REFERENCES)}, got {reference!r}")
    attack = create_attack(name, **settings)
    reason = attack.applies(model, batch_size, "single-step")
    if reason:
        raise VeilError(f"not applicable: {reason}")
    batches = private_batches(data.test, batch_size, samples, seed)
    on = attack_device(device)
    model.to(on)
    rows, shown = [], []
    for i, batch in enumerate(_progress(batches, progress, name)):
        with attack_progress(progress):  # a bar over the attack's work inside the update
            rec, ref, _ = attack_once(attack, model, batch, defenses, data, reference, update_seed(seed, i))
        rows.append(score(rec, ref, data))
        shown.append((ref, rec))
    means = mean_metrics(rows)
    summary = {
        "attacks": {name: means},
        "runs": {
            name: {
                "settings": settings,
                "batch_size": batch_size,
                "samples": samples,
                "reference": reference,
                "seed": seed,
                "device": on.type,
                "per_sample": rows,
                "defenses": [d.describe() for d in defenses],
                **({"weights": weights} if weights is not None else {}),
            }
        },
    }
    if config is not None:
        summary["config"] = config
    if weights is not None:
        summary["weights"] = weights
    if out is not None:
        summary = write_outputs(out, name, summary, shown, data)
    return summary


def _progress(items: list, on: bool, name: str) -> Any:
    if not on:
        return items
    from tqdm import tqdm

    return tqdm(items, desc=f"attack {name}", unit="update", leave=False)


def write_outputs(out: Path, name: str, summary: dict[str, Any], shown: list, data: Any) -> dict[str, Any]:
    """Merge into OUT/summary.json (other attacks' entries are kept) and draw the picture."""
    from veil.attacks.harness import sequences

    out.mkdir(parents=True, exist_ok=True)
    path = out / "summary.json"
    if path.is_file():
        old = json.loads(path.read_text())
        for key in ("attacks", "runs"):
            summary[key] = {**old.get(key, {}), **summary[key]}
    path.write_text(json.dumps(summary, indent=2, default=str))
    if any(rec.images is not None for _, rec in shown):
        save_image_grid(
            out / f"{name}.png", [(ref["pixels"], rec.images) for ref, rec in shown if rec.images is not None], name
        )
    if any(rec.token_ids is not None for _, rec in shown):
        save_text_alignment(
            out / f"{name}.md",
            [(sequences(ref), rec.token_ids) for ref, rec in shown if rec.token_ids is not None],
            data.meta.get("tokenizer"),
            name,
        )
    return summary


def save_image_grid(path: Path, pairs: list[tuple[Tensor, Tensor]], title: str) -> None:
    """Originals (top row) above reconstructions (bottom row), up to 16 images."""
    import torch

    from veil.report.figures import image_grid

    orig = torch.cat([o for o, _ in pairs]).detach().cpu()[:16]
    recs = torch.cat([r[: len(o)] for o, r in pairs]).detach().cpu().clamp(0, 1)[:16]
    image_grid(orig.numpy(), recs.numpy(), path, title)


def save_text_alignment(
    path: Path, pairs: list[tuple[list[list[int]], list[list[int]]]], tokenizer: Any, title: str
) -> None:
    """Each reference beside its best-matching reconstruction; wrong tokens struck through."""
    from veil.metrics import text_report

    def words(ids: list[int]) -> list[str]:
        return list(tokenizer.decode(ids)) if tokenizer is not None else [str(i) for i in ids]

    lines = [f"# {title}: reconstructions", "", "Wrong tokens are ~~struck through~~ at their position.", ""]
    for k, (refs, hyps) in enumerate(pairs):
        order = text_report(refs, hyps)["order"] if hyps else [-1] * len(refs)
        for i, ref in enumerate(refs):
            hyp = hyps[order[i]] if order[i] >= 0 else []
            marked = [w if j < len(ref) and hyp[j] == ref[j] else f"~~{w}~~" for j, w in enumerate(words(hyp))]
            lines += [
                f"**sample {k} / sequence {i}**",
                "",
                f"- original: {' '.join(words(ref))}",
                f"- recovered: {' '.join(marked)}",
                "",
            ]
    path.write_text("\n".join(lines))


def format_table(name: str, metrics: dict[str, float]) -> str:
    width = max(len(k) for k in metrics) if metrics else 6
    lines = [f"attack {name}", "-" * (width + 14)] + [f"{k:<{width}}  {v:>12.4f}" for k, v in metrics.items()]
    return "\n".join(lines)


if __name__ == "__main__":  # python -m veil.commands.attack ...
    import sys

    parser = argparse.ArgumentParser(prog="veil")
    add_parser(parser.add_subparsers())
    ns = parser.parse_args(["attack", *sys.argv[1:]])
    try:
        sys.exit(ns.run(ns))
    except VeilError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
