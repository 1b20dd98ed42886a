"""`veil audit [SCENARIO] [--out OUT]`: from a scenario to a privacy-utility report.

With no scenario it runs the embedded quickstart (a digits ViT and an SST-2 text model, MJP and
AEGIS against their attacks). Running it again resumes: finished runs and cells are reused.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from veil.errors import VeilError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "audit", help="train one model per defense, attack each, write a privacy-utility report", description=__doc__
    )
    p.add_argument("scenario", nargs="?", default=None, help="scenario YAML (default: the embedded quickstart)")
    p.add_argument("--out", default="runs/audit", help="audit folder (default: runs/audit); an existing one is resumed")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument(
        "--jobs",
        type=int,
        default=0,
        help="worker processes for the training runs and attack cells, one torch thread each "
        "(default 0: the cores the machine can give now); the numbers do not depend on it",
    )
    p.set_defaults(run=run)


def audit(scenario: Any, out: str | Path, progress: bool = True, jobs: int = 0) -> dict[str, Any]:
    """Run (or resume) a parsed scenario into `out`, then render its report from the summary and
    the examples the engine hands over: what `veil audit` does. Returns the summary."""
    # torch and the packages load when the command runs, not when `veil --help` builds the parser
    from veil.experiments.audit import run_audit
    from veil.experiments.cells import examples
    from veil.report.render import write_reports

    summary = run_audit(scenario, out, progress=progress, jobs=jobs)
    write_reports(summary, Path(out), {name: examples(Path(out), name) for name in summary["tasks"]})
    return summary


def run(args: argparse.Namespace) -> int:
    from veil.experiments.scenario import load_scenario  # the engine's parser, light: a bad scenario is refused at once

    if args.jobs < 0:
        raise VeilError(f"--jobs must be an integer >= 0 (0: the free cores), got {args.jobs}")
    scenario = load_scenario(args.scenario)
    from veil.metrics.leakage import describe  # veil.metrics loads torch: see audit()
    from veil.report.headline import task_verdict

    summary = audit(scenario, args.out, progress=not args.quiet, jobs=args.jobs)

    for name, t in summary["tasks"].items():
        print(f"{name}:")
        for d, u in t["utility"].items():  # the verdict per defense: the attack that rebuilt the most
            acc = f"{u['test_accuracy_mean']:.3f}" if "test_accuracy_mean" in u else "— (at init)"
            worst = describe(t["worst_case"][d], 3, ("token_recovery", "psnr", "psnr_masked_set")).replace("`", "")
            print(f"  {d}: acc {acc}; worst case {worst}; verdict {task_verdict(t, d)}")
    print(f"report: {args.out}/report.html")
    return 0
