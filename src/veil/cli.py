"""The `veil` command. Each subcommand lives in `veil/commands/<name>.py` with
`add_parser(subparsers)` and `run(args) -> int`. A bad input prints one line and exits 2.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

from veil import __version__
from veil.errors import VeilError
from veil.runlock import hold

COMMANDS = ("train", "eval", "attack", "federate", "split", "audit", "analyze", "list", "pretrain", "export")
#: seconds after which a stage off a terminal prints a line when it ends (`plain_progress`)
LONG = 10.0
#: commands whose --out is a run folder they write: one writer at a time (veil.runlock)
WRITERS = ("train", "attack", "federate", "split", "audit")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="veil",
        description="Train Transformers with privacy defenses in federated and split learning, and audit them with the attacks a curious server would run.",
    )
    parser.add_argument("--version", action="version", version=f"veil {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:  # every listed command exists: a missing one is a bug, not a shorter menu
        importlib.import_module(f"veil.commands.{name}").add_parser(sub)
    return parser


#: a command's input path argument, and how its absence is said: checked before torch loads
INPUTS = {
    "config": "config file '{}' does not exist",
    "run_dir": "run folder '{}' does not exist",
    "source": "'{}' does not exist; give a run folder written by `veil train` or a YAML config",
    "scenario": "scenario '{}' does not exist",
}


def _check_inputs(args: argparse.Namespace) -> None:
    """Refuse a missing input file or folder at once, in the words its command would use later."""
    for attr, message in INPUTS.items():
        path = getattr(args, attr, None)
        if isinstance(path, str) and path and not os.path.exists(path):
            raise VeilError(message.format(path))


def _out_lock(args: argparse.Namespace) -> contextlib.AbstractContextManager:
    """The run folder's write lock for commands that write one; nothing for the others."""
    if args.command not in WRITERS or not getattr(args, "out", None):
        return contextlib.nullcontext()
    return hold(args.out)


@contextlib.contextmanager
def plain_progress(on: bool) -> Iterator[None]:
    """While `on` (stderr is not a terminal), every tqdm bar is off and each stage that would
    have shown one prints one line instead, `veil: train (60 step)`, once per stage name, and a
    stage that ran `LONG` seconds or more one line when it ends (`veil: span done in 95 s`)."""
    if not on:
        yield
        return
    from tqdm import std  # light: no torch

    real, real_close, seen = std.tqdm.__init__, std.tqdm.close, set()

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        shown = not kwargs.get("disable", False)
        kwargs["disable"] = True
        real(self, *args, **kwargs)
        desc = kwargs.get("desc") or (args[1] if len(args) > 1 and isinstance(args[1], str) else None)
        if shown and desc:
            self._veil_stage = (desc, time.monotonic())
        if shown and desc and desc not in seen:
            seen.add(desc)
            total = kwargs.get("total")
            if total is None and args and hasattr(args[0], "__len__"):
                total = len(args[0])
            unit = kwargs.get("unit", "it")
            print(f"veil: {desc}" + (f" ({total} {unit})" if total else ""), file=sys.stderr, flush=True)

    def close(self: Any) -> None:
        desc, t0 = self.__dict__.pop("_veil_stage", (None, 0.0))
        if desc is not None and time.monotonic() - t0 >= LONG:
            print(f"veil: {desc} done in {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
        real_close(self)

    std.tqdm.__init__, std.tqdm.close = init, close
    try:
        yield
    finally:
        std.tqdm.__init__, std.tqdm.close = real, real_close


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    kv = [a for a in extra if "=" in a and not a.startswith("-")]
    if extra != kv or (kv and not hasattr(args, "overrides")):
        parser.error(
            f"unrecognized arguments: {' '.join(a for a in extra if a not in kv or not hasattr(args, 'overrides'))}"
        )
    if kv:  # key=value overrides may also follow the options
        args.overrides = list(args.overrides or []) + kv
    if not getattr(args, "run", None):
        parser.print_help()
        return 0 if args.command is None else 2
    tty = sys.stderr.isatty()
    try:
        _check_inputs(args)
        with _out_lock(args), plain_progress(not tty):
            return int(args.run(args) or 0)
    except VeilError as e:
        print(f"veil: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # on a terminal, below the bar the interrupt cut off
        print(("\n" if tty else "") + "veil: interrupted; run the same command again to resume", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
