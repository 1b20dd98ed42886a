"""Check privacy claims empirically (issue 44): one-run canary auditing (Steinke, Nasr, Jagielski
2023) of DP-SGD at several claimed epsilons, of the undefended run and of MJP / AEGIS (which claim
no epsilon), and membership inference on every released model, on a text and an image task.

    python benchmarks/dp_audit.py [--scenario dp_audit] [--scenario dp_audit_minilm] [--write]
    python benchmarks/dp_audit.py --render      # re-splice the section from the collected JSON only

Runs (or resumes: every (task, defense, seed) is a cached file) each scenario
(configs/paper/NAME.yaml, into runs/paper/NAME) through the audit engine (`protocol: dp-audit`,
`veil.experiments.dp_audit`), collects its summary to docs/results/SCENARIO.json (hashed), draws
each task's membership ROC (log-log) to docs/figures/dp-audit_TASK_roc.png, and with `--write`
splices the `dp-audit` section of docs/results.md, rendered by
`results.sections.dp_audit` from those JSON files (as `python -m results`
does). The Flower part (`veil.federated.fedavg.dp_audit.canary_clients`: client-level DP with
canary clients, the strategy wrapper `veil federate` builds) goes to
docs/results/bench/dp-audit-flower.json. One torch thread.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the results book (`results/`) is a repository folder, not an installed package


#: the Flower runs: (federated.dp, claimed epsilon or None for no noise)
FLOWER = (("server-fixed", 8.0), ("server-fixed", 1.0), ("server-fixed", None), ("client-fixed", 8.0))
FLOWER_SETUP = {"clients": 100, "fraction": 0.1, "rounds": 100, "canaries": 1000, "clip": 1.0, "delta": 1e-5}


def flower_audits() -> dict:
    """Canary-client audits of Flower's client-level DP at the FLOWER settings (seed 0)."""
    from veil.federated.fedavg.dp_audit import canary_clients

    logging.disable(logging.INFO)  # Flower logs every aggregation
    rows = []
    for kind, eps in FLOWER:
        t0 = time.perf_counter()
        noise = {"target_epsilon": eps} if eps is not None else {"noise": 0.0}
        r = canary_clients(kind=kind, **FLOWER_SETUP, **noise)
        r["seconds"] = time.perf_counter() - t0
        print(f"flower {kind} claimed {r['claimed_epsilon']}: eps-hat {r['eps_hat']:.3f} ({r['seconds']:.0f} s)")
        rows.append(r)
    logging.disable(logging.NOTSET)
    return {"setup": FLOWER_SETUP, "runs": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", action="append", help="configs/paper/NAME.yaml (repeatable; default: both)")
    ap.add_argument("--write", action="store_true", help="splice the dp-audit section into docs/results.md")
    ap.add_argument("--render", action="store_true", help="only splice the section from the collected JSON (no run)")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)

    from results import Section, cache_of, collect, figures_of, render_section, splice
    from results.sections import dp_audit as section
    from veil.experiments.audit import run_audit
    from veil.experiments.scenario import load_scenario
    from veil.io import atomic_write_text, write_checked_text
    from veil.report.dp_audit import curves_of, roc_figure, slug

    DOC = ROOT / "docs" / "results.md"
    CACHE, FIGURES = cache_of(DOC), figures_of(DOC)

    for name in [] if args.render else args.scenario or ["dp_audit", "dp_audit_minilm"]:
        t0 = time.perf_counter()
        summary = run_audit(load_scenario(ROOT / "configs/paper" / f"{name}.yaml"), ROOT / "runs/paper" / name)
        print(f"audit {name}: {time.perf_counter() - t0:.0f} s (cached cells cost nothing)")
        for task, t in summary["tasks"].items():
            for d, e in t.get("dp_audit", {}).items():
                print(
                    f"{task} / {d}: claimed {e['claimed_epsilon']}, eps-hat {e['eps_hat']:.3f}, flagged {e['flagged']}"
                )
            if t.get("membership"):
                roc_figure(curves_of(t), FIGURES / f"dp-audit_{slug(task)}_roc.png", f"{task}: membership ROC")
        print(f"collected {collect(ROOT / 'runs/paper' / name, None, CACHE, FIGURES)}")
    if not args.render:
        path = CACHE / "bench" / "dp-audit-flower.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        write_checked_text(path, json.dumps(flower_audits(), indent=1) + "\n")
        print(f"wrote {path}")
    if args.write or args.render:
        body = render_section(Section("dp-audit", section), CACHE)
        if body is None:
            raise SystemExit(f"the dp-audit section's sources are not all collected: {section.SOURCES}")
        atomic_write_text(DOC, splice(DOC.read_text(), "dp-audit", body))
        print(f"spliced the dp-audit section into {DOC}")


if __name__ == "__main__":
    main()
