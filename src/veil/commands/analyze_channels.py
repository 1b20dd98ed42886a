"""`veil analyze channels (RUN_DIR | CONFIG) [key=value ...] [--batch-size 4] [--out DIR]`:
the three gradient leakage channels AEGIS closes, per layer, for one client step of the run's
model (trained weights when RUN_DIR has them) under its defenses.

Prints the table and writes channels.json and channels.md into DIR (default
RUN_DIR/analysis/channels, or runs/channels/<config name> for a CONFIG file).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from veil.commands import subcommand
from veil.config import load_config
from veil.errors import VeilError


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `channels` under the `veil analyze` subcommands."""
    p = subcommand(
        sub,
        "channels",
        "AEGIS leakage channels per layer: gradient rank, span overlap, embedding-row sparsity",
        __doc__,
        run,
    )
    p.add_argument("source", help="a run folder written by `veil train`, or a YAML config")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. defense=aegis mlp_noise=0")
    p.add_argument("--batch-size", type=int, default=4, help="sentences in the analysed step (default 4)")
    p.add_argument("--tol", type=float, default=0.01, help="relative span distance counted as a hit (default 0.01)")
    p.add_argument("--seed", type=int, default=0, help="which training batch (seeded pick)")
    p.add_argument("--out", default=None, help="output folder")
    p.add_argument(
        "--checkpoint",
        default=None,
        metavar="last|STEP|init",
        help="which weights to read when the run has no finished model (default: the finished model)",
    )


def run(args: argparse.Namespace) -> int:
    # torch and the packages load when the command runs, not when `veil --help` builds the parser
    import torch

    from veil.analysis.channels import analyze_channels, markdown_table
    from veil.build import build_run, load_run

    if args.batch_size < 1:
        raise VeilError(f"--batch-size must be >= 1, got {args.batch_size}")
    src = Path(args.source)
    if src.is_dir():
        cfg, model, data, defenses = load_run(src, args.overrides, args.checkpoint)
        out = Path(args.out) if args.out else src / "analysis" / "channels"
    else:
        cfg = load_config(src, args.overrides)
        model, data, defenses = build_run(cfg)
        out = (
            Path(args.out) if args.out else Path("runs") / "channels" / src.stem
        )  # not beside the config: keep configs/ clean
    if data.modality != "text":
        raise VeilError(
            "veil analyze channels measures text models (token embedding, attention, MLP); this run is " + data.modality
        )
    n = len(data.train["labels"])
    if n < 2 * args.batch_size:
        raise VeilError(
            f"--batch-size {args.batch_size} needs at least {2 * args.batch_size} training samples; the data has {n}"
        )
    order = torch.randperm(n, generator=torch.Generator().manual_seed(args.seed))
    batch = {k: v[order[: args.batch_size]] for k, v in data.train.items()}
    decoy = {k: v[order[args.batch_size : 2 * args.batch_size]] for k, v in data.train.items()}
    special = set(data.meta.get("special_ids", []))
    result = analyze_channels(model, batch, decoy, defenses, args.tol, special)
    title = f"{cfg.model['name']} on {cfg.data['name']} + {'+'.join(d['name'] for d in cfg.defense) or 'no defense'}"
    result["title"] = title
    result["defenses"] = [d.describe() for d in defenses]
    out.mkdir(parents=True, exist_ok=True)
    (out / "channels.json").write_text(json.dumps(result, indent=2, default=str))
    md = markdown_table(result, title)
    (out / "channels.md").write_text(md)
    print(md)
    print(f"wrote {out / 'channels.json'} and {out / 'channels.md'}")
    return 0
