"""`run_split(spec, run_dir)`: one split-learning protocol end to end (Flower messages on the
in-process grid or Ray), or the centralised reference; writes RUN_DIR/summary.json with each
task's metric and the measured bytes beside the paper's formulas (Table V)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from veil.federated.grid import run_local, run_ray
from veil.federated.split.client_app import app
from veil.federated.split.models import build_body
from veil.federated.split.multitask import TASK_DEFS, build_parts, split_world
from veil.federated.split.server_app import server_main, split_summary
from veil.federated.split.spec import SplitSpec
from veil.io import atomic_write_text


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


def run_split(spec: SplitSpec, run_dir: str | Path, progress: bool = False) -> dict[str, Any]:
    run_dir = Path(run_dir)
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
        run_local(main, app, n) if spec.split.backend == "inline" else run_ray(main, app, n, spec.split.num_cpus)
    summary["seconds"] = round(time.perf_counter() - t0, 2)
    atomic_write_text(run_dir / "summary.json", json.dumps(summary, indent=2))
    if progress:
        print(json.dumps(summary["metrics"]), flush=True)
    return summary
