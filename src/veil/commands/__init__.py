"""One module per `veil` subcommand: `add_parser(subparsers)` and `run(args) -> int`."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def subcommand(
    sub: argparse._SubParsersAction, name: str, help: str, doc: str | None, run: Callable[[argparse.Namespace], int]
) -> argparse.ArgumentParser:
    """Add the subcommand `name` to `sub`: its one-line `help`, its module docstring `doc` as the
    description (laid out as written) and `run` as what it does."""
    p = sub.add_parser(name, help=help, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.set_defaults(run=run)
    return p


def config_arguments(p: argparse.ArgumentParser, config: str, example: str, out: str = "run folder") -> None:
    """The arguments of a command that runs a config: CONFIG (help `config`), its key=value
    overrides (help: `example` of them) and the required --out folder (help `out`)."""
    p.add_argument("config", help=config)
    p.add_argument("overrides", nargs="*", help=f"key=value overrides, e.g. {example}")
    p.add_argument("--out", required=True, help=out)
