"""README.md's quickstart numbers, pasted from the run a user makes with the README's command
(never typed by hand), and checked against it.

    veil audit --out runs/audit                       # the README's quickstart command
    python scripts/readme_numbers.py runs/audit       # rewrite the README's blocks from that run
    python scripts/readme_numbers.py runs/audit --check   # exit 1 if the README differs from it
    python scripts/readme_numbers.py runs/audit --wall 612 --load 3.1 --note "..."   # and the timing line

Blocks (between <!-- NAME:start --> and <!-- NAME:end -->): `quickstart`, the report's
defense x attack matrices and each task's tables without the census and without the columns that
time the machine (attack seconds, step times: they differ between runs, the numbers do not);
`headline`, one line per task (accuracy and worst case per defense); `quickstart-time`, the wall
time of that run and the machine's load when it started (only with --wall and --load).

The run must be the embedded quickstart scenario (`veil audit` without a scenario): a run of
another scenario is refused in one line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from veil.report.headline import leak_line
from veil.report.markup import to_markdown
from veil.report.render import summary_blocks

ROOT = Path(__file__).resolve().parent.parent
COMMAND = "veil audit --out runs/audit"
#: the census block (every tensor, per defense) stays in report.md: too long for the README
CENSUS = "What the server sees (census of the exported update)"
#: columns that time the machine: they differ between two runs of one command, so they stay out
TIMED = ("seconds", "step time vs none (median)", "step time vs none (median, quartiles)", "client step")


def replace_block(text: str, name: str, body: str) -> str:
    """`text` with the lines between <!-- name:start --> and <!-- name:end --> replaced by `body`."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    if start not in text or end not in text:
        raise SystemExit(f"README.md has no block '{name}' (markers {start} ... {end})")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{start}\n{body.strip()}\n{end}{tail}"


def block(text: str, name: str) -> str:
    """The body of block `name` in `text`."""
    return text.split(f"<!-- {name}:start -->", 1)[1].split(f"<!-- {name}:end -->", 1)[0].strip()


def _untimed(b: tuple) -> tuple:
    """A table block without the columns that time the machine."""
    keep = [j for j, h in enumerate(b[1]) if h not in TIMED]
    return ("table", [b[1][j] for j in keep], [[row[j] for j in keep] for row in b[2]])


def quickstart_tables(summary: dict[str, Any]) -> str:
    """The matrices, then per task its verdict, utility and per-attack tables (Markdown)."""
    keep, skip = [], False
    with tempfile.TemporaryDirectory() as scratch:  # the figures it draws are not kept
        blocks = summary_blocks({**summary, "versions": summary.get("versions", {})}, Path(scratch))
    for b in blocks:
        if b[0] == "h2" and b[1] == "Software":
            break
        if b[0] in ("h2", "h3"):
            skip = b[1] in (CENSUS, "What the server rebuilt")
        if skip:
            continue
        if b[0] == "matrix":
            keep.append(b)
        elif b[0] == "table":
            keep.append(_untimed(b))
        elif b[0] == "p" and b[1].startswith("**"):
            keep.append(b)
        elif (b[0] == "h2" and b[1].startswith("Task")) or b[0] == "h3":
            keep.append(("p", f"**{b[1]}**"))
    md = to_markdown(keep, Path("."))
    return (
        md.rstrip() + f"\n\n*Measured by `{COMMAND}` (the command above); `python scripts/readme_numbers.py "
        "runs/audit` rewrites this block from that run's summary.json and `--check` fails where they differ. "
        "Attack and step times are in report.md: they differ between runs.*"
    )


def headline(summary: dict[str, Any]) -> str:
    """One line per task: per defense, the accuracy and the worst case (the attack that rebuilt the most)."""
    lines = [
        "Headline numbers of the quickstart audit (one seed, small models, CPU); leakage is the worst case "
        "over the attacks that ran (`worst_case` in summary.json):",
        "",
    ]
    for name, t in summary["tasks"].items():
        parts = []
        for d, u in t["utility"].items():
            wc = t.get("worst_case", {}).get(d)
            leak = f"; worst case {leak_line(wc)}" if wc else ""
            parts.append(f"**{d}**: accuracy {u['test_accuracy_mean']:.3f}{leak}")
        lines.append(f"- `{name}` ({t['model']} on {t['data']}) — " + " · ".join(parts))
    return "\n".join(lines)


def timing(wall: float, load: float, note: str = "") -> str:
    """The README's timing line for one run of the quickstart command (`note`: how loaded the
    machine was while it ran, in words)."""
    took = f"{wall / 60:.0f} minutes" if wall >= 120 else f"{wall:.0f} seconds"
    return (
        f"On this machine ({os.cpu_count()} cores) `{COMMAND}` took **{took}** ({wall:.0f} s wall, "
        f"`/usr/bin/time`), started at a one-minute load of {load:.1f}" + (f"; {note}" if note else "") + "."
    )


def load_run(out: Path) -> dict[str, Any]:
    """The run's summary.json, refused in one line unless it is the embedded quickstart scenario."""
    from veil.experiments.scenario import default_scenario_path

    path = out if out.suffix == ".json" else out / "summary.json"
    if not path.is_file():
        raise SystemExit(f"'{path}' does not exist: run `{COMMAND}` first (its --out is the folder to give)")
    summary = json.loads(path.read_text())
    quickstart = yaml.safe_load(default_scenario_path().read_text())
    if summary.get("config") != quickstart:
        raise SystemExit(
            f"'{out}' is not a run of the embedded quickstart scenario (its config differs from "
            "src/veil/configs/quickstart.yaml): the README's numbers come from `veil audit` without a scenario"
        )
    return summary


def render(text: str, summary: dict[str, Any], out: Path) -> str:
    """README text with the quickstart and headline blocks rendered from `summary`."""
    text = replace_block(text, "quickstart", quickstart_tables(summary))
    return replace_block(text, "headline", headline(summary))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "run", type=Path, help="the folder of `veil audit --out FOLDER` (the quickstart scenario), or its summary.json"
    )
    ap.add_argument("--check", action="store_true", help="exit 1 if README.md's blocks differ from the run")
    ap.add_argument("--readme", type=Path, default=ROOT / "README.md")
    ap.add_argument("--wall", type=float, help="the run's wall seconds (with --load: rewrite the timing line)")
    ap.add_argument("--load", type=float, help="the one-minute load when the run started")
    ap.add_argument("--note", default="", help="how loaded the machine was during the run, in words")
    args = ap.parse_args(argv)
    summary = load_run(args.run)
    source = args.run if args.run.suffix == ".json" else args.run / "summary.json"
    text = args.readme.read_text()
    new = render(text, summary, args.run)
    if args.check:
        stale = [name for name in ("quickstart", "headline") if block(text, name) != block(new, name)]
        if stale:
            print(
                f"README.md differs from {source} in: {', '.join(stale)} "
                f"(python scripts/readme_numbers.py {args.run} rewrites them)",
                file=sys.stderr,
            )
            return 1
        print(f"README.md matches {source}")
        return 0
    if args.wall is not None and args.load is not None:
        new = replace_block(new, "quickstart-time", timing(args.wall, args.load, args.note))
    args.readme.write_text(new)
    print(f"README.md updated from {source}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
