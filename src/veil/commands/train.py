"""`veil train CONFIG [key=value ...] --out RUN_DIR`"""

from __future__ import annotations

import argparse
import json

from veil.commands import config_arguments
from veil.config import load_config


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a model (with defenses) from a YAML config", description=__doc__)
    config_arguments(
        p,
        "YAML config file, or a run folder to resume",
        "train.epochs=3 defense=mjp gamma=0.1",
        "run folder (created; an existing one is resumed)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)  # a bad config is refused before torch loads
    from veil.training.loop import train

    summary = train(cfg, args.out, progress=not args.quiet)
    print(json.dumps(summary, indent=2))
    return 0
