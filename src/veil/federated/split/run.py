"""`run_split(spec, run_dir)`: one split-learning protocol end to end (Flower messages on the
in-process grid or Ray), or the centralised reference; writes RUN_DIR/summary.json with each
task's metric and the measured bytes beside the paper's formulas (Table V)."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from veil.federated.grid import run_local, run_ray
from veil.federated.split.client_app import app
from veil.federated.split.comm import paper_cost
from veil.federated.split.models import build_body
from veil.federated.split.multitask import TASK_DEFS, build_parts, split_world
from veil.federated.split.server_app import SplitServer
from veil.federated.split.spec import SplitSpec, permutes
from veil.training.checkpoint import atomic_write_text


def _nbytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.state_dict().values())


def paper_table(server: SplitServer) -> dict[str, Any]:
    """The paper's per-client costs for this run's sizes, every protocol (bytes)."""
    head, tail = build_parts(server.spec, server.sc.tasks[0])
    side = head.patch * math.isqrt(head.pos.shape[0])  # image side = patch x grid
    x = torch.zeros(1, head.proj.in_features // head.patch**2, side, side)
    with torch.no_grad():
        F = head(x).numel() * 4
        full = server.body(head(x)).numel() * 4
    # G: bytes of the body output (= of its gradient) per sample that the tails read, mean over tasks
    G = sum(full if TASK_DEFS[t].reads_patches else full // (head(x).shape[1] + 1) for t in server.sc.tasks) / len(
        server.sc.tasks
    )
    D = sum(server.size.values()) / len(server.size)
    R = server.sc.epochs
    n = server.unify / server.steps_per_epoch
    sizes = dict(D=D, R=R, n=n, F=F, G=G, P_h=_nbytes(head), P_b=_nbytes(server.body), P_t=_nbytes(tail))
    return {"inputs": sizes, **{p: paper_cost(p, **sizes) for p in ("fl", "sl", "festa", "pfesta")}}


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
    summary: dict[str, Any] = {
        "protocol": spec.split.protocol,
        "freeze_head": spec.split.freeze_head,
        "tasks": list(spec.split.tasks),
        "permute": permutes(spec),
        "clients_per_task": spec.split.clients_per_task,
        "epochs": spec.split.epochs,
        "metric_names": {t: TASK_DEFS[t].metric_name for t in spec.split.tasks},
    }
    if spec.split.protocol == "central":
        summary["metrics"] = central(spec)
    else:

        def main(grid: Any, context: Any) -> None:
            server = SplitServer(grid, spec)
            server.train_fl() if spec.split.protocol == "fl" else server.train_split()
            summary["metrics"] = server.evaluate()
            clients = len(server.nodes)
            summary.update(
                {
                    "bytes": server.ex.train.as_dict(),
                    "bytes_per_client": server.ex.train.total() / clients,
                    "eval_bytes": server.ex.eval.total(),
                    "paper_bytes_per_client": paper_table(server),
                    "steps": server.total,
                    "unify_every": server.unify,
                }
            )
            with (run_dir / "metrics.jsonl").open("w") as f:
                for e in server.events:
                    f.write(json.dumps(e) + "\n")

        n = len(spec.split.tasks) * spec.split.clients_per_task
        run_local(main, app, n) if spec.split.backend == "inline" else run_ray(main, app, n, spec.split.num_cpus)
    summary["seconds"] = round(time.perf_counter() - t0, 2)
    atomic_write_text(run_dir / "summary.json", json.dumps(summary, indent=2))
    if progress:
        print(json.dumps(summary["metrics"]), flush=True)
    return summary
