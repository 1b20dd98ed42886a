"""The live privacy auditor: a Flower strategy wrapper playing the honest-but-curious server.

`AuditedStrategy(inner)` is a `flwr.serverapp.strategy.Strategy` that delegates aggregation to
any Flower strategy (FedAvg, FedProx, ...) and, before aggregating, runs the chosen attacks on
the updates it received — exactly what a curious server could do with them:

  fedsgd  the update is the client's defended gradient g            -> Observation(kind="gradient")
  fedavg  the update is new weights w_k after s local steps at lr   -> pseudo-gradient
          (w_global - w_k) / (lr * s)                                -> Observation(kind="delta")

Threat model and scoring. An attack receives only the Observation (global model + update) and
the Knowledge a server has (configured batch size, input shape, the defense settings); never a
private sample. To *score* what it rebuilt, the auditor hands the Reconstruction to a separate
evaluation channel, `score(round, partition, digest, reconstruction)`, held outside the strategy:
`BatchOracle` re-derives the client's batch from the public seed schedule and its own copy of
the partition (possible only in simulation) and checks it against the SHA-256 receipt the client
sent, so scores are reported only for the batch the client really used (`verified`). In a real
deployment no oracle exists and events carry only the attack's own statistics.

It also makes sampling and aggregation order deterministic (sampled by partition id with a
seeded RNG, replies sorted by partition id) — so a resumed run is bit-identical — and logs
every failed or missing client instead of stopping the round.
"""
from __future__ import annotations

import copy
import math
import random
from typing import Any, Callable, Iterable

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from veil.attacks import Attack, Knowledge, Observation, Reconstruction, create_attack
from veil.federated.task import ClientWorld, client_split, local_batches, batch_digest
from veil.models.base import VeilModel

Score = Callable[[int, int, str, Reconstruction], dict[str, Any]]


class _SampledGrid(Grid):
    """A view of a Grid whose node list is the round's sample (the inner strategy takes all of it)."""

    def __init__(self, grid: Grid, nodes: list[int]) -> None:
        self._grid, self._nodes = grid, nodes

    def set_run(self, run: Any) -> None:
        self._grid.set_run(run)

    @property
    def run(self) -> Any:
        return self._grid.run

    def create_message(self, *a: Any, **k: Any) -> Message:
        return self._grid.create_message(*a, **k)

    def get_node_ids(self) -> list[int]:
        return list(self._nodes)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        return self._grid.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return self._grid.pull_messages(message_ids)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        return self._grid.send_and_receive(messages, timeout=timeout)


class Auditor:
    """Runs attacks on one round's updates; returns one event per (client, attack)."""

    def __init__(self, model: VeilModel, attacks: list[dict[str, Any]], know: Knowledge, mode: str,
                 every: int = 1, max_clients: int = 1, score: Score | None = None) -> None:
        self.model = copy.deepcopy(model)
        self.attacks: list[tuple[str, Attack]] = [(a["name"], create_attack(a["name"], **{k: v for k, v in a.items() if k != "name"}))
                                                  for a in attacks]
        self.know, self.mode, self.every, self.max_clients, self.score = know, mode, every, max_clients, score

    def due(self, rnd: int) -> bool:
        return bool(self.attacks) and self.max_clients > 0 and (rnd % self.every == 0 or rnd == 1)

    def observation(self, global_arrays: ArrayRecord, reply: Message, lr: float) -> Observation:
        self.model.load_state_dict(global_arrays.to_torch_state_dict())
        update = reply.content["arrays"].to_torch_state_dict()
        if self.mode == "fedsgd":
            return Observation(self.model, {k: v.float() for k, v in update.items()}, kind="gradient")
        steps = max(1, int(reply.content["metrics"]["steps"]))
        grads = {n: (p.detach() - update[n]) / (lr * steps) for n, p in self.model.named_parameters() if p.requires_grad}
        return Observation(self.model, grads, kind="delta")

    def audit(self, rnd: int, global_arrays: ArrayRecord, replies: list[Message], lr: float) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for reply in replies[: self.max_clients]:
            pid = int(reply.content["metrics"]["partition-id"])
            obs = self.observation(global_arrays, reply, lr)
            digest = str(reply.content["receipt"]["digest"]) if "receipt" in reply.content else ""
            for name, attack in self.attacks:
                ev: dict[str, Any] = {"event": "audit", "round": rnd, "client": pid, "attack": name, "update": obs.kind}
                reason = attack.applies_to(obs.model)
                if reason:
                    events.append({**ev, "skipped": reason})
                    continue
                torch.manual_seed(self.know.seed + rnd)
                try:
                    rec = attack.reconstruct(obs, self.know)
                except Exception as e:  # noqa: BLE001 - a failing attack is logged, never stops training
                    events.append({**ev, "error": f"{type(e).__name__}: {e}"[:300]})
                    continue
                ev["seconds"] = round(float(rec.stats.get("seconds", 0.0)), 3)
                if self.score is not None:
                    ev.update(self.score(rnd, pid, digest, rec))
                events.append(ev)
        return events


class AuditedStrategy(Strategy):
    """Wraps a Flower strategy: deterministic sampling and order, failure log, live audit."""

    def __init__(self, inner: Strategy, partition_of: dict[int, int], fraction: float, seed: int,
                 auditor: Auditor | None = None) -> None:
        self.inner, self.partition_of, self.fraction, self.seed, self.auditor = inner, partition_of, fraction, seed, auditor
        self.events: list[dict[str, Any]] = []
        self._sent: dict[int, list[int]] = {}
        self._global: dict[int, tuple[ArrayRecord, float]] = {}

    def summary(self) -> None:
        self.inner.summary()

    def sample(self, rnd: int) -> list[int]:
        """Node ids of the round's clients, chosen by partition id with an RNG seeded by (seed, round)."""
        by_pid = sorted(self.partition_of, key=self.partition_of.get)
        k = max(1, int(math.ceil(len(by_pid) * self.fraction)))
        if k >= len(by_pid):
            return by_pid
        pick = random.Random(self.seed * 7919 + rnd).sample(range(len(by_pid)), k)
        return [by_pid[i] for i in sorted(pick)]

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        nodes = self.sample(server_round)
        self._sent[server_round] = nodes
        self._global[server_round] = (arrays, float(config["lr"]))
        random.seed(self.seed * 7919 + server_round)  # the inner strategy shuffles with `random`
        return self.inner.configure_train(server_round, arrays, config, _SampledGrid(grid, nodes))

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = list(replies)
        ok = sorted((m for m in replies if not m.has_error()), key=lambda m: int(m.content["metrics"]["partition-id"]))
        self._log_failures(server_round, replies, ok)
        arrays, lr = self._global.pop(server_round)
        if self.auditor is not None and ok and self.auditor.due(server_round):
            self.events.extend(self.auditor.audit(server_round, arrays, ok, lr))
        if not ok:
            return None, None
        return self.inner.aggregate_train(server_round, ok)

    def _log_failures(self, rnd: int, replies: list[Message], ok: list[Message]) -> None:
        answered = {m.metadata.src_node_id for m in replies}
        for m in replies:
            if m.has_error():
                self.events.append({"event": "client_failure", "round": rnd, "client": self.partition_of.get(m.metadata.src_node_id, -1),
                                    "reason": str(m.error.reason)[:300]})
        for node in self._sent.pop(rnd, []):
            if node not in answered:
                self.events.append({"event": "client_failure", "round": rnd, "client": self.partition_of.get(node, -1),
                                    "reason": "no reply before the round timeout"})

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        return self.inner.configure_evaluate(server_round, arrays, config, _SampledGrid(grid, self.sample(server_round)))

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return self.inner.aggregate_evaluate(server_round, [m for m in replies if not m.has_error()])


class BatchOracle:
    """The evaluation channel: re-derives a client's round batches (simulation only) to score a
    reconstruction, and checks them against the client's SHA-256 receipt."""

    def __init__(self, world: ClientWorld) -> None:
        self.world = world

    def batches(self, rnd: int, pid: int) -> list[dict[str, torch.Tensor]]:
        spec = self.world.spec
        steps = 1 if spec.fed.mode == "fedsgd" else spec.fed.local_steps
        return list(local_batches(client_split(self.world, pid), spec.cfg.train.batch_size, spec.cfg.train.seed, rnd, pid,
                                  spec.fed.local_epochs, steps))

    def __call__(self, rnd: int, pid: int, digest: str, rec: Reconstruction) -> dict[str, Any]:
        """`veil.attacks.harness.score` against every distinct sample the client trained on this round
        (images, text — tokens and their bag — and labels alike)."""
        from veil.attacks.harness import score

        batches = self.batches(rnd, pid)
        out: dict[str, Any] = {"verified": batch_digest(batches) == digest}
        truth = {k: torch.cat([b[k] for b in batches]) for k in batches[0]}
        key = "pixels" if "pixels" in truth else "input_ids"
        _, idx = np.unique(truth[key].flatten(1).numpy(), axis=0, return_index=True)  # epochs repeat samples
        truth = {k: v[np.sort(idx)] for k, v in truth.items()}
        if rec.images is not None:
            rec.images = rec.images.detach().cpu().float().clamp(0, 1)
        out.update({k: float(v) for k, v in score(rec, truth, self.world.data).items() if k != "seconds"})
        return out
