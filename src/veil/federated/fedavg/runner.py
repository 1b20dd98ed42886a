"""`federate(spec, run_dir)`: run veil's ServerApp + ClientApp in Flower's simulation engine (Ray)
or on the in-process grid, resuming from the run folder's checkpoint when one is there."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from veil.errors import VeilError
from veil.federated.fedavg.task import Spec
from veil.io import settle
from veil.runlock import holds_progress


def check_run_dir(spec: Spec, run_dir: Path, resume: bool) -> dict[str, Any] | None:
    """A finished run returns its summary; a different config or an unasked resume is an error."""
    cfg = run_dir / "config.yaml"
    if not cfg.is_file():
        return None
    if cfg.read_text() != spec.text():
        if not holds_progress(run_dir):  # a run that failed before its first round: the corrected one takes over
            return None
        raise VeilError(f"run folder '{run_dir}' holds a different config; pick a new --out or remove it")
    if (run_dir / "summary.json").is_file():
        return json.loads((run_dir / "summary.json").read_text())
    settle(run_dir / "checkpoints")
    if not resume and (run_dir / "checkpoints" / "state.json").is_file():
        raise VeilError(
            f"run folder '{run_dir}' holds an interrupted run; add --resume to continue it or pick a new --out"
        )
    return None


def federate(
    spec: Spec, run_dir: str | Path, resume: bool = False, progress: bool = False, verbose: bool = False
) -> dict[str, Any]:
    from veil.federated.fedavg.client_app import app as client_app
    from veil.federated.fedavg.server_app import server_main
    from veil.federated.grid import run_local, run_ray

    run_dir = Path(run_dir)
    done = check_run_dir(spec, run_dir, resume)
    if done is not None:
        return done
    if spec.fed.clients > 1 and spec.fed.backend == "ray" and spec.fed.num_cpus <= 0:
        raise VeilError("federated.num_cpus must be positive")
    out: dict[str, Any] = {}

    def main(grid: Any, context: Any) -> None:
        out.update(server_main(grid, spec, run_dir, progress=progress))

    if spec.fed.backend == "inline":
        run_local(main, client_app, spec.fed.clients)
    else:
        run_ray(main, client_app, spec.fed.clients, spec.fed.num_cpus, verbose)
    if not out:
        raise VeilError(
            f"the federated run stopped before finishing; see {run_dir}/metrics.jsonl, then rerun with --resume"
        )
    return out
