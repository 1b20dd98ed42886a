"""Running a veil ServerApp + ClientApp pair: in Flower's simulation engine (Ray), or on an
in-process `LocalGrid` for tests and for chatty split-learning exchanges.

`LocalGrid` is a real Flower `Grid`: every message (down and up) is serialised to its protobuf
bytes and parsed back before the other side sees it, so nothing crosses by reference — the same
isolation a SuperLink gives — and its byte count is exact. A client that raises becomes an error
reply (as in Flower's engine); one that outlives the timeout is dropped from the round.
"""

from __future__ import annotations

import functools
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.common.serde import message_from_proto, message_to_proto
from flwr.serverapp import Grid
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

from veil.federated.comm import Ledger

ServerMain = Callable[[Grid, Context], None]


def _roundtrip(msg: Message) -> tuple[Message, int]:
    proto = message_to_proto(msg)
    return message_from_proto(proto), int(proto.ByteSize())


class LocalGrid(Grid):
    """Sequential, in-process Grid over `num_nodes` ClientApp instances (node ids 1001, 1002, ...);
    `node_config(i)` adds to node i's config (partition-id, num-partitions), as a SuperNode's
    --node-config does."""

    def __init__(
        self,
        client_app: ClientApp,
        num_nodes: int,
        run_id: int = 1,
        ledger: Ledger | None = None,
        node_config: Callable[[int], dict[str, Any]] | None = None,
    ) -> None:
        TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, run_id, SUPERLINK_NODE_ID
        self.app = client_app
        self._run = Run.create_empty(run_id=run_id)
        self.ledger = ledger or Ledger()
        self.nodes = {
            1001 + i: Context(
                run_id=run_id,
                node_id=1001 + i,
                node_config={"partition-id": i, "num-partitions": num_nodes, **(node_config(i) if node_config else {})},
                state=RecordDict(),
                run_config={},
            )
            for i in range(num_nodes)
        }
        self._replies: dict[str, Message] = {}

    def set_run(self, run: Run) -> None:
        self._run = run

    @property
    def run(self) -> Run:
        return self._run

    def create_message(
        self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str, ttl: float | None = None
    ) -> Message:
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        return list(self.nodes)

    def push_messages(self, messages: Iterable[Message], timeout: float | None = None) -> Iterable[str]:
        ids = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = str(uuid.uuid4())
            ids.append(msg.metadata.message_id)
            reply = self._deliver(msg, timeout)
            if reply is not None:
                self._replies[msg.metadata.message_id] = reply
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return [self._replies.pop(i) for i in list(message_ids) if i in self._replies]

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        return self.pull_messages(self.push_messages(messages, timeout))

    def _deliver(self, msg: Message, timeout: float | None) -> Message | None:
        """Serialise down, run the ClientApp (in a thread, to honour the timeout), serialise up."""
        inbound, size = _roundtrip(msg)
        self.ledger.sent(msg, size)
        ctx = self.nodes[msg.metadata.dst_node_id]
        box: dict[str, Any] = {}

        def work() -> None:
            try:
                box["reply"] = self.app(inbound, ctx)
            except BaseException as e:  # noqa: BLE001 - a client crash becomes an error reply, as in Flower
                box["reply"] = Message(Error(code=2, reason=f"{type(e).__name__}: {e}"), reply_to=inbound)

        worker = threading.Thread(target=work, daemon=True)
        worker.start()
        worker.join(timeout)
        if "reply" not in box:
            return None  # timed out: the round goes on without this client
        reply = box["reply"]
        reply.metadata.__dict__["_message_id"] = str(uuid.uuid4())
        outbound, size = _roundtrip(reply)
        self.ledger.received(outbound, size)
        return outbound


def run_local(
    server_main: ServerMain,
    client_app: ClientApp,
    num_nodes: int,
    node_config: Callable[[int], dict[str, Any]] | None = None,
) -> LocalGrid:
    grid = LocalGrid(client_app, num_nodes, node_config=node_config)
    server_main(grid, Context(run_id=1, node_id=SUPERLINK_NODE_ID, node_config={}, state=RecordDict(), run_config={}))
    return grid


def run_ray(
    server_main: ServerMain, client_app: ClientApp, num_nodes: int, num_cpus: float = 1.0, verbose: bool = False
) -> None:
    """Flower's simulation engine (Ray): one virtual SuperNode per client."""
    import logging

    from flwr.serverapp import ServerApp
    from flwr.simulation import run_simulation

    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    server = ServerApp()
    server.main()(server_main)
    cores = max(1, os.cpu_count() or 1)
    backend = {
        "client_resources": {"num_cpus": num_cpus, "num_gpus": 0.0},
        "init_args": {
            "num_cpus": cores,
            "include_dashboard": False,
            "log_to_driver": verbose,
            "logging_level": logging.INFO if verbose else logging.ERROR,
        },
    }
    if not verbose:
        logging.getLogger("flwr").setLevel(logging.WARNING)
    run_simulation(server_app=server, client_app=client_app, num_supernodes=num_nodes, backend_config=backend)


def push(grid: Grid, messages: list[Message], timeout: float) -> list[str | None]:
    """Push `messages`; their ids in order (None for one the SuperLink refused)."""
    return list(grid.push_messages(messages, timeout) if isinstance(grid, LocalGrid) else grid.push_messages(messages))


def pull(grid: Grid, ids: list[str]) -> list[Message]:
    """The replies that have arrived to the messages `ids` (each is returned once)."""
    return list(grid.pull_messages(ids))


def exchange(grid: Grid, messages: Iterable[Message], timeout: float, poll: float = 0.05) -> list[Message]:
    """`grid.send_and_receive` with a short pull interval: Flower's Grid waits 3 s between pulls
    from the SuperLink, which would dominate a round whose training takes a second or two."""
    msgs = list(messages)
    ids = set(grid.push_messages(msgs, timeout) if isinstance(grid, LocalGrid) else grid.push_messages(msgs))
    end, out = time.time() + timeout, []
    while ids:
        got = list(grid.pull_messages(ids))
        out += got
        ids -= {m.metadata.reply_to_message_id for m in got}
        if not ids or time.time() >= end:
            break
        time.sleep(poll)
    return out


def quick_pulls(initial: float = 0.02, cap: float = 0.25) -> None:
    """Retry a not-yet-available object after 20 ms (doubling to 250 ms) instead of Flower 1.42's
    1 s (doubling to 10 s, `PULL_INITIAL_BACKOFF`): a message's objects are often still in flight
    when its receiver first asks, and the fixed second then costs more than the round's training.
    Sets the defaults where the ServerApp's grid, the SuperNode and its ClientApp runtime pull."""
    import flwr.superlink.grid.http_grid as http_grid
    import flwr.supernode.runtime.run_clientapp as run_clientapp
    import flwr.supernode.start_client_internal as supernode
    from flwr.supercore.inflatable import inflatable_utils as iu

    for module, name in (
        (http_grid, "pull_objects"),
        (supernode, "pull_objects"),
        (run_clientapp, "pull_and_inflate_object_from_tree"),
    ):
        setattr(module, name, functools.partial(getattr(iu, name), initial_backoff=initial, backoff_cap=cap))


def wait_for_nodes(grid: Grid, n: int, timeout: float = 300.0) -> list[int]:
    end = time.time() + timeout
    while len(ids := list(grid.get_node_ids())) < n:
        if time.time() > end:
            raise RuntimeError(f"only {len(ids)} of {n} SuperNodes connected within {timeout:.0f} s")
        time.sleep(0.2)
    return sorted(ids)
