"""`veil federate CONFIG [key=value ...] --out RUN_DIR [--resume]`

Federated training on Flower: FedAvg / FedProx / FedSGD over IID or Dirichlet client partitions,
defenses on the clients, optional live privacy audit by the server. The config's `federated:`
section holds the settings (see `veil.federated.fedavg.config`); override them as `federated.rounds=5`.
"""

from __future__ import annotations

import argparse
import json

from veil.commands import config_arguments, subcommand


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = subcommand(
        sub, "federate", "federated training on Flower (simulation engine), with a live privacy auditor", __doc__, run
    )
    config_arguments(p, "YAML config with a federated: section, or a run folder", "federated.clients=3 train.lr=0.002")
    p.add_argument("--resume", action="store_true", help="continue an interrupted run from its last round checkpoint")
    p.add_argument("--quiet", action="store_true", help="no per-round progress lines")
    p.add_argument("--verbose", action="store_true", help="show Flower / Ray logs")


def run(args: argparse.Namespace) -> int:
    from veil.federated.fedavg.runner import federate
    from veil.federated.fedavg.task import load_spec

    spec = load_spec(args.config, args.overrides)
    summary = federate(spec, args.out, resume=args.resume, progress=not args.quiet, verbose=args.verbose)
    print(json.dumps(summary, indent=2))
    return 0
