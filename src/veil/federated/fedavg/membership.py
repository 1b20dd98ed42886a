"""Who holds which silo, kept current while nodes fail, leave and come back (dynamic membership).

A silo is identified by its `partition-id` (`veil.federated.fedavg.silo`), a node by the id the
SuperLink gave it. Before each round the server asks every node it does not know yet (a new or
restarted SuperNode) and every node it holds for dead whose silo has no live node which silo it
serves (a `query` message); the answer maps the silo to that node (the newest answer wins, and the
silo's previous node id is dead from then on), so a node that rejoins — under the same id or a new one —
gets its silo back and trains it in the next round. A node whose reply failed or never came is
known dead and is not sampled until it answers a query again; a silo with no live node sits the
round out. Events: `client_rejoin` (a silo served by another node than before).

A node is asked once: its query stays pending (its reply is taken whenever it comes, in a later
wait or round) and is sent again only after `3 x query_timeout`. Re-asking every node at every
wait piled up queries faster than 500 simulated clients on 2 cores answered them, so no wait ever
saw its own replies (`only 0 of 500 silos joined within 600 s`).
"""

from __future__ import annotations

import time
from typing import Any

from flwr.app import ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid

from veil.errors import VeilError
from veil.federated.grid import pull, push


class Membership:
    """partition id <-> node id for `clients` silos over a Flower `Grid`."""

    def __init__(self, grid: Grid, clients: int, config: dict[str, Any], query_timeout: float) -> None:
        self.grid, self.clients, self.config, self.query_timeout = grid, clients, config, query_timeout
        self.node_of: dict[int, int] = {}  # partition id -> node id
        self.sizes: dict[int, int] = {}  # partition id -> its number of training samples
        self.own_data: set[int] = set()  # partition ids that train on their own data-path
        self.dead: set[int] = set()
        self.events: list[dict[str, Any]] = []
        self.pending: dict[str, tuple[int, float]] = {}  # query message id -> (node id, when it was sent)

    def partition_of(self) -> dict[int, int]:
        """node id -> partition id of the silos whose node is live (what a round may sample)."""
        online = set(self.grid.get_node_ids())
        return {n: p for p, n in self.node_of.items() if n in online and n not in self.dead}

    def mark_dead(self, node: int) -> None:
        self.dead.add(node)

    def refresh(self, rnd: int) -> None:
        """Ask new nodes, then dead ones whose silo still has no live node, which silo they serve."""
        online = sorted(set(self.grid.get_node_ids()))
        self.ask(rnd, [n for n in online if n not in self.node_of.values()], online)
        live = {p for p, n in self.node_of.items() if n in online and n not in self.dead}
        self.ask(rnd, [n for p, n in self.node_of.items() if n in self.dead and n in online and p not in live], online)

    def ask(self, rnd: int, nodes: list[int], online: list[int]) -> None:
        """Query `nodes` (those without a recent pending query), then take every pending reply until
        these nodes have answered or `query_timeout` has passed."""
        now = time.time()
        self.pending = {i: (n, t) for i, (n, t) in self.pending.items() if now - t < 3 * self.query_timeout}
        waiting = {n for n, _ in self.pending.values()}
        fresh = [n for n in nodes if n not in waiting]
        if fresh:
            msgs = [
                Message(RecordDict({"config": ConfigRecord(dict(self.config))}), dst_node_id=n, message_type="query")
                for n in fresh
            ]
            ids, sent = push(self.grid, msgs, self.query_timeout), time.time()
            self.pending.update({mid: (n, sent) for mid, n in zip(ids, fresh) if mid is not None})
        want, end = set(nodes), time.time() + self.query_timeout
        while self.pending:
            for m in pull(self.grid, list(self.pending)):
                self.pending.pop(m.metadata.reply_to_message_id, None)
                self.answer(rnd, m)
            if not want & {n for n, _ in self.pending.values()} or time.time() >= end:
                return
            time.sleep(0.05)

    def answer(self, rnd: int, m: Message) -> None:
        """A query reply: map its silo to the node that sent it."""
        if m.has_error():
            reason = str(m.error.reason)
            if "VeilError" in reason:  # a misconfigured node: say so, once
                raise VeilError(f"a SuperNode could not load its silo: {reason[:300]}")
            return
        node, pid = m.metadata.src_node_id, int(m.content["info"]["partition-id"])
        before = self.node_of.get(pid)
        if before is not None and before != node:
            self.dead.add(before)  # the silo moved (a restarted node): its old id is gone for good
        if before is not None and (before != node or node in self.dead):
            self.events.append({"event": "client_rejoin", "round": rnd, "client": pid, "node": node})
        self.node_of[pid], self.sizes[pid] = node, int(m.content["info"]["num-examples"])
        if int(m.content["info"].get("own-data", 0)):
            self.own_data.add(pid)
        self.dead.discard(node)

    def wait_for_all(self, timeout: float) -> None:
        """Block until every silo 0..clients-1 has a live node (the first round starts complete)."""
        end = time.time() + timeout
        while True:
            self.refresh(0)
            if len(self.node_of) == self.clients:
                self.events.clear()
                return
            if time.time() > end:
                missing = sorted(set(range(self.clients)) - set(self.node_of))
                shown = ", ".join(map(str, missing[:10])) + (
                    f", ... ({len(missing)} in all)" if len(missing) > 10 else ""
                )
                raise VeilError(
                    f"only {len(self.node_of)} of {self.clients} silos joined within {timeout:.0f} s; "
                    f"missing partition-id {shown}"
                )
            time.sleep(0.5)
