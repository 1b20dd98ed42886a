"""`veil list`: the registered models, data sets, defenses and attacks."""
from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("list", help="list models, data sets, defenses and attacks", description=__doc__)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from veil.attacks import ATTACKS, _load_builtin as load_attacks
    from veil.data import DATASETS
    from veil.defenses import DEFENSES, _load_builtin as load_defenses
    from veil.models import MODELS

    load_attacks()
    load_defenses()
    for title, reg in (("models", MODELS), ("data sets", DATASETS), ("defenses", DEFENSES), ("attacks", ATTACKS)):
        print(f"{title}:")
        for name, help in reg.describe().items():
            print(f"  {name:<20} {help}")
    return 0
