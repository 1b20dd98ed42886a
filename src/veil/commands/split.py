"""`veil split CONFIG [key=value ...] --out RUN_DIR`

Split learning on Flower messages: SL, FeSTA, p-FeSTA (permutation module) or the FL / central
references, multi-task (classification, zone regression, segmentation on digits). Settings in the
config's `split:` section (see `veil.federated.split.spec.SplitConfig`), e.g. split.protocol=sl.
`--compare` runs every protocol plus single-task p-FeSTA and writes RUN_DIR/compare.json.
"""

from __future__ import annotations

import argparse
import json

from veil.commands import config_arguments, subcommand


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = subcommand(
        sub, "split", "split learning (SL, FeSTA, p-FeSTA) on Flower, multi-task, with byte accounting", __doc__, run
    )
    config_arguments(p, "YAML config with a split: section", "split.protocol=sl split.epochs=5")
    p.add_argument("--compare", action="store_true", help="run central, fl, sl, festa, pfesta and single-task pfesta")


def run(args: argparse.Namespace) -> int:
    from veil.federated.split.run import run_split
    from veil.federated.split.spec import load_split_spec

    spec = load_split_spec(args.config, args.overrides)
    if not args.compare:
        print(json.dumps(run_split(spec, args.out), indent=2))
        return 0
    from veil.federated.split.compare import compare

    print(json.dumps(compare(spec, args.out), indent=2))
    return 0
