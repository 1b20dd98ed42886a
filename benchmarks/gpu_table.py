"""Collect one lent-GPU run of `benchmarks/gpu_run.sh` (issue 21) into docs/results/bench/gpu.json
(the `gpu` section's source) and docs/results/bench/aegis-overhead-gpu.json (the
`aegis-overhead-gpu` section's), hashed as `veil.io` writes cached results; then
`python -m results` renders both.

    python benchmarks/gpu_table.py DIR [DIR ...] [--date YYYY-MM-DD]

Each DIR is a folder the device run's $OUT came back to (a run may be split over two calls: the
files are looked up in every DIR, the later DIR winning): span_*.json (`span_scale.py --out`),
ig_gpu.json (`ig_vs_breaching.py --json`), aegis_gpu.json (`aegis_overhead.py --suite --json`) and
run.log (the gpu-marked tests' line, the GPU's and libraries' names).
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from veil.io import write_checked_text  # noqa: E402

BENCH = ROOT / "docs" / "results" / "bench"
CELL_KEYS = ("model", "batch", "budget", "tokens", "rank1", "token_recovery", "exact_recovery", "wall_s", "cpu_s")
CELL_KEYS += ("sentences_scored", "budget_stopped", "samples")


def latest(dirs: list[Path], pattern: str) -> dict[str, Path]:
    """File name -> path, over every DIR (the later DIR winning)."""
    found: dict[str, Path] = {}
    for d in dirs:
        found.update({p.name: p for p in sorted(d.glob(pattern))})
    return found


def span(dirs: list[Path]) -> dict:
    runs = [json.loads(p.read_text()) for p in latest(dirs, "span_*.json").values()]
    if not runs:
        sys.exit("gpu_table: no span_*.json in " + ", ".join(map(str, dirs)))
    cells = sorted(
        ({k: c[k] for k in CELL_KEYS if k in c} for r in runs for c in r["cells"]),
        key=lambda c: (c["model"], c["batch"]),
    )
    # span_scale.py joined its arguments without quoting before it used shlex.join: put back the empty one
    cmds = [r["command"].replace("--rank-batches  ", '--rank-batches "" ') for r in runs]
    return {"commands": cmds, "machine": runs[0]["env"]["machine"], "cells": cells}


def ig(path: Path) -> dict:
    d = json.loads(path.read_text())
    med = lambda side, key: statistics.median(r[key] for r in d["ig"][side])  # noqa: E731
    return {
        "command": d["command"],
        "veil_it_s": med("veil", "it_s"),
        "breaching_it_s": med("breaching", "it_s"),
        "veil_psnr": med("veil", "psnr"),
        "breaching_psnr": med("breaching", "psnr"),
        "runs": len(d["ig"]["veil"]),
        "iterations_s": {k: [r["seconds"] for r in v] for k, v in d["ig"].items()},
        "april": d["april"],
    }


def run_log(dirs: list[Path]) -> dict:
    logs = latest(dirs, "run.log")
    text = logs["run.log"].read_text() if logs else ""
    tests = re.search(r"^(\d+ passed[^\n]*)", text, re.M)
    libs = re.search(r"^torch (\S+) transformers (\S+) (.+)$", text, re.M)
    return {
        "tests": tests.group(1) if tests else "not run",
        "torch": libs.group(1) if libs else "?",
        "transformers": libs.group(2) if libs else "?",
        "gpu": libs.group(3).strip() if libs else "?",
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dirs", nargs="+", type=Path)
    ap.add_argument("--date", default=datetime.date.today().isoformat(), help="the day the GPU run was made")
    args = ap.parse_args()
    doc = {"date": args.date, **run_log(args.dirs), "span": span(args.dirs)}
    igs = latest(args.dirs, "ig_gpu.json")
    if igs:
        doc["ig"] = ig(igs["ig_gpu.json"])
    aegis = latest(args.dirs, "aegis_gpu.json")
    if aegis:
        rows = json.loads(aegis["aegis_gpu.json"].read_text())
        doc["aegis"] = rows
        write_checked_text(BENCH / "aegis-overhead-gpu.json", json.dumps(rows, indent=1) + "\n")
    write_checked_text(BENCH / "gpu.json", json.dumps(doc, indent=1) + "\n")
    print(f"written {BENCH / 'gpu.json'}" + (" and aegis-overhead-gpu.json" if aegis else ""))


if __name__ == "__main__":
    main()
