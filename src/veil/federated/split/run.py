"""`run_split(spec, run_dir)`: one split-learning protocol end to end (Flower messages on the
in-process grid or Ray), or the centralised reference; writes RUN_DIR/summary.json with each
task's metric and the measured bytes beside the paper's formulas (Table V).

Like `veil train`, an existing run folder is continued: a finished run (intact summary.json)
returns its summary, an interrupted one resumes from RUN_DIR/checkpoints
(`veil.federated.split.checkpoint`), and a folder holding progress of another config is refused.
On the in-process grid each client keeps its own state (head, tail, Adam, permutation keys) in
RUN_DIR/clients/clientN, which stands for that client's machine; the server's side never reads it.
Ray's virtual clients have no state folder, so a Ray run starts over when rerun."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from veil.errors import VeilError
from veil.federated.grid import run_local, run_ray
from veil.federated.split.client_app import app
from veil.federated.split.models import build_body
from veil.federated.split.multitask import TASK_DEFS, build_parts, split_world
from veil.federated.split.server_app import server_main, split_summary
from veil.federated.split.spec import SplitSpec
from veil.io import atomic_write_text, intact, write_checked_text
from veil.runlock import holds_progress


def central(spec: SplitSpec) -> dict[str, float]:
    """Each task trained on its pooled client data in one place (same model, epochs, batch, lr)."""
    world = split_world(spec.text())
    out: dict[str, float] = {}
    for t in spec.split.tasks:
        head, tail = build_parts(spec, t)
        body = build_body(spec)
        mods = nn.ModuleList([head, body, tail])
        head.requires_grad_(not spec.split.freeze_head)
        opt = torch.optim.Adam([p for p in mods.parameters() if p.requires_grad], lr=spec.cfg.train.lr)
        data = [d for name, d in world.clients if name == t]
        pooled = {k: torch.cat([d[k] for d in data]) for k in data[0]}
        g = torch.Generator().manual_seed(spec.cfg.train.seed)
        bs, n = spec.cfg.train.batch_size, len(pooled["target"])
        task = TASK_DEFS[t]
        for _ in range(spec.split.epochs):
            perm = torch.randperm(n, generator=g)
            for i in range(0, n, bs):
                b = {k: v[perm[i : i + bs]] for k, v in pooled.items()}
                loss = task.loss(tail(body(head(b["pixels"]))), b["target"])
                opt.zero_grad()
                loss.backward()
                opt.step()
        test = world.tests[t]
        with torch.no_grad():
            mods.eval()
            out[t] = task.metric(tail(body(head(test["pixels"]))), test["target"])
    return out


def _finished(spec: SplitSpec, run_dir: Path) -> dict[str, Any] | None:
    """A finished run's summary; a different config with progress is a one-line error."""
    cfg = run_dir / "config.yaml"
    if not cfg.is_file():
        return None
    if cfg.read_text() != spec.text():
        if holds_progress(run_dir):
            raise VeilError(f"run folder '{run_dir}' holds a different config; pick a new --out or remove it")
        return None
    summary = run_dir / "summary.json"
    return json.loads(summary.read_text()) if intact(summary) else None


def client_state_dir(run_dir: Path, pid: int) -> Path:
    """Where in-process client `pid` keeps its own state (its machine's disk, in a deployment)."""
    return run_dir / "clients" / f"client{pid}"


def run_split(spec: SplitSpec, run_dir: str | Path, progress: bool = False) -> dict[str, Any]:
    run_dir = Path(run_dir)
    done = _finished(spec, run_dir)
    if done is not None:
        return done
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(run_dir / "config.yaml", spec.text())
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    summary = split_summary(spec)
    if spec.split.protocol == "central":
        summary["metrics"] = central(spec)
    else:

        def main(grid: Any, context: Any) -> None:
            summary.update(server_main(grid, spec, run_dir))

        n = len(spec.split.tasks) * spec.split.clients_per_task
        if spec.split.backend == "inline":
            run_local(main, app, n, node_config=lambda pid: {"state-dir": str(client_state_dir(run_dir, pid))})
        else:
            run_ray(main, app, n, spec.split.num_cpus)
    summary["seconds"] = round(time.perf_counter() - t0, 2)
    write_checked_text(run_dir / "summary.json", json.dumps(summary, indent=2))
    if progress:
        print(json.dumps(summary["metrics"]), flush=True)
    return summary
