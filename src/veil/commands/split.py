"""`veil split CONFIG [key=value ...] --out RUN_DIR`

Split learning on Flower messages: SL, FeSTA, p-FeSTA (permutation module) or the FL / central
references, multi-task (classification, zone regression, segmentation on digits). Settings in the
config's `split:` section (see `veil.federated.split.spec.SplitConfig`), e.g. split.protocol=sl.
`--compare` runs every protocol plus single-task p-FeSTA and writes RUN_DIR/compare.json.
"""

from __future__ import annotations

import argparse
import json


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "split",
        help="split learning (SL, FeSTA, p-FeSTA) on Flower, multi-task, with byte accounting",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("config", help="YAML config with a split: section")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. split.protocol=sl split.epochs=5")
    p.add_argument("--out", required=True, help="run folder")
    p.add_argument("--compare", action="store_true", help="run central, fl, sl, festa, pfesta and single-task pfesta")
    p.set_defaults(run=run)


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
