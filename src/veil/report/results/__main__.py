"""`python -m veil.report.results [--check]` and `python -m veil.report.results collect RUN_DIR`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from veil.errors import VeilError
from veil.report.results import CACHE, DOC, check, collect, write


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m veil.report.results", description=__doc__)
    ap.add_argument("command", nargs="?", choices=["render", "collect"], default="render")
    ap.add_argument("run_dir", nargs="?", help="collect: the audit folder holding summary.json")
    ap.add_argument("--name", help="collect: the cache name (default: the scenario's name)")
    ap.add_argument("--check", action="store_true", help="exit 1 and print the diff when docs/results.md differs")
    ap.add_argument("--doc", type=Path, default=DOC)
    ap.add_argument("--cache", type=Path, default=CACHE)
    a = ap.parse_args(argv)
    try:
        if a.command == "collect":
            if not a.run_dir:
                raise VeilError("collect needs RUN_DIR (an audit folder holding summary.json)")
            print(f"wrote {collect(Path(a.run_dir), a.name, a.cache)}")
            return 0
        if a.check:
            diff = check(a.doc, a.cache)
            sys.stdout.write(diff)
            return 1 if diff else 0
        print(f"rendered {', '.join(write(a.doc, a.cache)) or 'no section'} into {a.doc}")
        return 0
    except VeilError as e:
        print(f"veil: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
