"""`veil analyze WHAT ...`: analyses of trained runs. Each analysis lives in
`veil/commands/analyze_<what>.py` with `add_parser(subparsers)` and `run(args)`.
"""

from __future__ import annotations

import argparse
import importlib

ANALYSES = ("pe", "channels", "tokens")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "analyze",
        help="analyses of trained runs (pe: position-embedding PCA; channels: AEGIS leakage channels; tokens: MJP Fig. 9)",
        description=__doc__,
    )
    inner = p.add_subparsers(dest="analysis", metavar="ANALYSIS")
    for name in ANALYSES:
        importlib.import_module(f"veil.commands.analyze_{name}").add_parser(inner)
