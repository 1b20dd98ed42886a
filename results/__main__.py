"""`python -m results [--check] [--docs PATH]` and `python -m results collect RUN_DIR [--docs PATH]`,
run from the repository root (the document defaults to `docs/results.md` under the current folder)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from results import DOC, cache_of, check, collect, figures_of, write
from veil.errors import VeilError


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m results", description=__doc__)
    ap.add_argument("command", nargs="?", choices=["render", "collect"], default="render")
    ap.add_argument("run_dir", nargs="?", help="collect: the audit folder holding summary.json")
    ap.add_argument("--name", help="collect: the cache name (default: the scenario's name)")
    ap.add_argument("--check", action="store_true", help="exit 1 and print the diff when the document differs")
    ap.add_argument("--docs", "--doc", dest="doc", type=Path, default=DOC, help=f"the document (default {DOC})")
    ap.add_argument("--cache", type=Path, help="the collected summaries (default: results/ beside the document)")
    a = ap.parse_args(argv)
    cache = a.cache or cache_of(a.doc)
    try:
        if not a.doc.is_file():
            raise VeilError(f"no results document at '{a.doc}' (run from the repository root, or pass --docs PATH)")
        if a.command == "collect":
            if not a.run_dir:
                raise VeilError("collect needs RUN_DIR (an audit folder holding summary.json)")
            print(f"wrote {collect(Path(a.run_dir), a.name, cache, figures_of(a.doc))}")
            return 0
        if a.check:
            diff = check(a.doc, cache)
            sys.stdout.write(diff)
            return 1 if diff else 0
        print(f"rendered {', '.join(write(a.doc, cache)) or 'no section'} into {a.doc}")
        return 0
    except VeilError as e:
        print(f"veil: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
