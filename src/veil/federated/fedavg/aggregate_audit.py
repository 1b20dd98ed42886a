"""The live auditor on an aggregate: what a curious server can attack when secure aggregation
(`veil.federated.fedavg.secagg`) hides every individual update and leaves it only the sum.

The weighted mean of N updates is, to first order, the update of one client that trained on the
union of their samples: in fedsgd with equal batches the mean gradient is exactly the gradient of
the union batch (mean loss); in fedavg the pseudo-gradient (w_global - mean_k w_k) / (lr s) mixes
N local trajectories. So the aggregate is attacked as one batch of B = sum_k b_k samples (b_k the
distinct samples client k trained on that round, from the public batch schedule), and every
attack first checks it applies to a batch of B (`Attack.applies`: APRIL needs B = 1; span
(DAGER) treats the sum as one large batch; presence, sparse-rows and labels read rows and biases
that add up over clients). A reconstruction is scored against every sampled client's samples of
the round (`BatchOracle.score_round`): the pool the server's rebuild could have come from.

Threat model of every event: ``server_saw`` names the view (the aggregate of N clients under
SecAgg+), ``knows`` the attack's declared knowledge. Attacks that need one client's updates
across rounds (`veil.attacks.multiround`) are skipped with the reason: the server holds no
individual update to remember.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from flwr.app import ArrayRecord, MetricRecord
from flwr.serverapp import Grid

from veil.attacks import Observation
from veil.federated.fedavg.auditor import MEMORY, Auditor
from veil.federated.fedavg.secagg import error_std, secure_round, train_metrics
from veil.federated.fedavg.strategy import AuditedStrategy
from veil.federated.fedavg.task import load_arrays


def server_saw(n: int) -> str:
    return f"the aggregate of {n} clients (SecAgg+)"


def union_batch(auditor: Auditor, rnd: int, pids: list[int], lr: float, steps: list[int]) -> int:
    """B, the distinct samples the sampled clients trained on this round (public schedule and sizes)."""
    bs = auditor.know.batch_size or 1
    if auditor.mode == "fedsgd":
        return bs * len(pids)
    total = 0
    for pid, s in zip(pids, steps, strict=True):
        local = auditor.local_training(rnd, pid, lr, s)
        total += local.samples if local is not None else bs * s
    return total


def aggregate_observation(
    auditor: Auditor,
    global_arrays: ArrayRecord,
    aggregate: dict[str, torch.Tensor],
    lr: float,
    steps: float,
    batch: int,
) -> Observation:
    """The aggregate as one update at the global weights: the mean gradient (fedsgd) or the
    pseudo-gradient (w_global - mean w_k) / (lr * mean local steps) (fedavg)."""
    load_arrays(auditor.model, global_arrays)
    if auditor.mode == "fedsgd":
        return Observation(
            auditor.model, {k: v.float() for k, v in aggregate.items()}, kind="gradient", batch_size=batch
        )
    scale = lr * max(1.0, steps)
    grads = {
        n: (p.detach() - aggregate[n].to(p.dtype)) / scale
        for n, p in auditor.model.named_parameters()
        if p.requires_grad and n in aggregate
    }
    return Observation(auditor.model, grads, kind="delta", batch_size=batch)


def audit_aggregate(
    auditor: Auditor,
    rnd: int,
    global_arrays: ArrayRecord,
    aggregate: dict[str, torch.Tensor],
    clients: list[dict[str, Any]],
    lr: float,
    quantization: float | None = None,
) -> list[dict[str, Any]]:
    """One event per attack on round `rnd`'s aggregate of `clients` (their clear-text metrics).
    `quantization`: the std bound of SecAgg+'s per-entry error on the aggregated values
    (`secagg.error_std`, from public settings and the clear-text weights), granted to
    mechanism-aware attackers as ``Knowledge.defense["secagg"]["entry_std"]`` in the units of the
    attacked update."""
    if not auditor.due(rnd) or not clients:
        return []
    pids = sorted(int(m["partition-id"]) for m in clients)
    steps = [max(1, int(m.get("steps", 1))) for m in sorted(clients, key=lambda m: int(m["partition-id"]))]
    batch = union_batch(auditor, rnd, pids, lr, steps)
    obs = aggregate_observation(auditor, global_arrays, aggregate, lr, sum(steps) / len(steps), batch)
    protocol = "fedsgd" if auditor.mode == "fedsgd" else "fedavg"
    granted = dict(auditor.know.defense)
    if quantization is not None:
        scale = 1.0 if auditor.mode == "fedsgd" else lr * max(1.0, sum(steps) / len(steps))
        granted["secagg"] = {"entry_std": quantization / scale}
    know, auditor.know = auditor.know, dataclasses.replace(auditor.know, batch_size=batch, defense=granted)
    score_round = getattr(auditor.score, "score_round", None)
    events = []
    try:
        for name, attack in auditor.attacks:
            ev: dict[str, Any] = {
                "event": "audit",
                "round": rnd,
                "client": "aggregate",
                "attack": name,
                "update": "aggregate",
                "clients": len(pids),
                "batch": batch,
                "server_saw": server_saw(len(pids)),
                "knows": str(getattr(attack, "knows", "")),
            }
            if attack.observes & MEMORY:
                events.append({**ev, "skipped": f"{name} remembers each client's updates; SecAgg+ shows none"})
                continue
            reason = attack.applies(obs.model, batch, protocol)
            if reason:
                events.append({**ev, "skipped": reason})
                continue
            events.append(auditor.run(attack, obs, ev, lambda rec: score_round(rnd, pids, rec) if score_round else {}))
    finally:
        auditor.know = know
    return events


def secure_train(
    grid: Grid, spec: Any, strategy: AuditedStrategy, rnd: int, arrays: ArrayRecord, config: dict[str, Any]
) -> tuple[ArrayRecord | None, MetricRecord | None, int, int, int, int]:
    """Round `rnd` under SecAgg+ (`veil.federated.fedavg.secagg`): the strategy's sample trains,
    the server unmasks the sum, the auditor attacks that aggregate (never a single update), lost
    clients are logged as `client_failure`. Returns (what the server applies, train metrics,
    sampled, contributed, bytes down, bytes up)."""
    nodes = strategy.sample(rnd)
    config = {**config, "server-round": rnd}
    if spec.fed.strategy == "fedprox":
        config["proximal-mu"] = float(spec.fed.proximal_mu)
    names = list(arrays.keys())
    out = secure_round(grid, spec.fed, nodes, rnd, names, arrays, config)
    metrics = [m for _, m in out.clients]
    got = {int(m["partition-id"]) for m in metrics}
    strategy.failed = []
    for node in nodes:
        pid = strategy.partition_of.get(node, -1)
        if pid not in got:
            strategy.failed.append(node)
            strategy.events.append(
                {"event": "client_failure", "round": rnd, "client": pid, "reason": "no masked update (SecAgg+ round)"}
            )
    bound = error_std(spec.fed.secagg, [w for w, _ in out.clients]) if out.clients else None
    if strategy.auditor is not None and out.aggregate is not None:
        strategy.events.extend(
            audit_aggregate(strategy.auditor, rnd, arrays, out.aggregate, metrics, float(config["lr"]), bound)
        )
    if hasattr(strategy.inner, "released"):
        strategy.inner.released = out.released is not None  # type: ignore[attr-defined]
    return out.released, train_metrics(out.clients), len(nodes), len(metrics), out.down, out.up
