"""`AuditedStrategy`: a Flower strategy wrapper that delegates aggregation to any Flower strategy
(FedAvg, FedProx, their DP wrappers) and, before aggregating, hands the round's updates to the live
privacy auditor (`veil.federated.fedavg.auditor.Auditor`).

It makes sampling and aggregation order deterministic (sampled by partition id with a seeded RNG,
replies sorted by partition id) — so a resumed run is bit-identical — and logs every failed or
missing client once instead of stopping the round (`failed`: the nodes the membership then holds
for dead).
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from veil.federated.fedavg.auditor import Auditor


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


class AuditedStrategy(Strategy):
    """Wraps a Flower strategy: deterministic sampling and order, failure log, live audit."""

    def __init__(
        self, inner: Strategy, partition_of: dict[int, int], fraction: float, seed: int, auditor: Auditor | None = None
    ) -> None:
        self.inner, self.partition_of, self.fraction, self.seed, self.auditor = (
            inner,
            partition_of,
            fraction,
            seed,
            auditor,
        )
        self.events: list[dict[str, Any]] = []
        self._sent: dict[int, list[int]] = {}
        self._global: dict[int, tuple[ArrayRecord, float]] = {}
        self.failed: list[int] = []  # node ids whose update the last round lost

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

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        nodes = self.sample(server_round)
        self._sent[server_round] = nodes
        self._global[server_round] = (arrays, float(config["lr"]))
        random.seed(self.seed * 7919 + server_round)  # the inner strategy shuffles with `random`
        return self.inner.configure_train(server_round, arrays, config, _SampledGrid(grid, nodes))

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = list(replies)
        ok = sorted((m for m in replies if not m.has_error()), key=lambda m: int(m.content["metrics"]["partition-id"]))
        self._log_failures(server_round, replies, ok)
        arrays, lr = self._global.pop(server_round)
        if self.auditor is not None and ok:
            self.auditor.record(arrays, ok, lr)
            if self.auditor.due(server_round):
                self.events.extend(self.auditor.audit(server_round, arrays, ok, lr))
            self.auditor.remember(server_round, arrays, ok, lr)
        if not ok:
            return None, None
        return self.inner.aggregate_train(server_round, ok)

    def _log_failures(self, rnd: int, replies: list[Message], ok: list[Message]) -> None:
        """One `client_failure` event per sampled node without a good reply (an error reply, or none
        before the timeout): a lost update is counted once, whoever reported it. `failed` lists them."""
        good = {m.metadata.src_node_id for m in ok}
        errors = {m.metadata.src_node_id: str(m.error.reason)[:300] for m in replies if m.has_error()}
        stray = [r for n, r in errors.items() if n not in self._sent.get(rnd, [])]  # e.g. from the SuperLink
        self.failed = []
        for node in self._sent.pop(rnd, []):
            if node in good:
                continue
            reason = errors.get(node) or (stray.pop(0) if stray else "no reply before the round timeout")
            self.failed.append(node)
            self.events.append(
                {"event": "client_failure", "round": rnd, "client": self.partition_of.get(node, -1), "reason": reason}
            )

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        return self.inner.configure_evaluate(
            server_round, arrays, config, _SampledGrid(grid, self.sample(server_round))
        )

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return self.inner.aggregate_evaluate(server_round, [m for m in replies if not m.has_error()])
