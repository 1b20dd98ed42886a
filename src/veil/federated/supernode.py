"""`python -m veil.federated.supernode [--tap DIR] [--poll S] -- FLOWER-SUPERNODE-ARGS...`: a Flower
SuperNode whose ClientApp stays warm across messages and rounds.

Flower 1.42 runs each message a SuperNode receives in a fresh `flwr-clientapp` process, started
by its SuperExec; a veil ClientApp then re-imports torch and rebuilds its model and data for every
message, which costs far more than a short round's training. Here the SuperNode runs with Flower's
process isolation (`--isolation process`: it starts no ClientApp process itself) and this process
is its executor: it takes each task from the SuperNode's Runtime API (loopback), installs and
loads the run's ClientApp once per app bundle, and runs the task in this process, so torch, the
model, the silo's data and the client world stay loaded. The task's `Context` goes back to the
SuperNode after every message, as Flower's own ClientApp processes do (split learning's head,
tail and permutation keys live there, on the silo's machine). A round then costs the training
plus the transfer.

The SuperNode itself runs in this process too (its command line is Flower's, passed after
`--`), so one process is the node: killing it leaves nothing behind. `--poll` is the SuperNode's
idle interval between asking the SuperLink for messages (Flower 1.42 waits 3 s; 0.2 s here, which
keeps a round from waiting on the poll).

A message of a run that is no longer RUNNING (round k+1's messages that a SuperLink restart
kept in its database for the killed run) is dropped with its task (`drop_stale_messages`: Flower
1.42 leaves that task queued, and a sequential executor then waits minutes for its objects ahead
of the resumed run's messages); a task that cannot be pulled is finished failed and the executor
goes on to the next one, and a revoked task token is that task's error, not the node's end
(`executor_retry_invoker`).

`--tap DIR` (tests, audits of what leaves the silo): write every message the node receives and
sends, as protobuf bytes, and its Context after every message, under DIR.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import threading
import time
import types
from pathlib import Path
from typing import Any

import httpx
from flwr.app import Error, Message
from flwr.cli.install import install_from_fab
from flwr.clientapp import ClientApp
from flwr.clientapp.utils import get_load_client_app_fn
from flwr.common.constant import ErrorCode, SubStatus
from flwr.common.serde import context_to_proto, message_to_proto
from flwr.proto.runtime_pb2 import AcquireTaskRequest  # type: ignore[attr-defined]
from flwr.supercore.constant import TaskType
from flwr.supercore.heartbeat import HeartbeatSender, make_task_heartbeat_fn_http
from flwr.supercore.interceptors import RuntimeTokenHttpInterceptor, RuntimeVersionHttpInterceptor
from flwr.supercore.retry import RetryInvoker, make_simple_http_retry_invoker
from flwr.supercore.run import RunNotRunningException
from flwr.supercore.runtime import RuntimeHttpClient
from flwr.supernode.runtime import run_clientapp
from flwr.supernode.runtime.run_clientapp import push_message, push_task_output

from veil.federated.grid import quick_pulls


def executor_retry_invoker() -> RetryInvoker:
    """Flower's retry policy for the Runtime API, except that a 401 (the task's token was revoked:
    the SuperNode finished or dropped the task meanwhile, e.g. `drop_stale_messages`) goes back to
    the caller. Flower's own policy sends SIGINT to its process on a 401, right for a one-task
    `flwr-clientapp` process, but this executor runs inside the SuperNode: that SIGINT stopped the
    whole node (seen after a SuperLink restart, when the executor had taken a stale task)."""
    invoker = make_simple_http_retry_invoker()
    flower = invoker.should_giveup

    def should_giveup(exc: Exception) -> bool:
        if isinstance(exc, httpx.HTTPStatusError) and exc.response.status_code == httpx.codes.UNAUTHORIZED:
            return True
        return bool(flower(exc)) if flower is not None else False

    invoker.should_giveup = should_giveup
    return invoker


class WarmExecutor:
    """Takes ClientApp tasks from a SuperNode's Runtime API and runs them in this process."""

    def __init__(self, runtime: str, tap: Path | None = None, poll: float = 0.05) -> None:
        self.runtime, self.tap, self.poll = runtime, tap, poll
        self.apps: dict[str, ClientApp] = {}
        self.count = 0

    def client(self, *interceptors: Any) -> RuntimeHttpClient:
        return RuntimeHttpClient.from_server_address(
            server_address=self.runtime,
            insecure=True,  # loopback, on the silo's machine
            root_certificates=None,
            interceptors=list(interceptors),
            retry_invoker=executor_retry_invoker(),
        )

    def serve(self) -> None:
        acquire = self.client(RuntimeVersionHttpInterceptor(component_name="SuperExec"))
        request = AcquireTaskRequest(supported_task_types=[str(TaskType.CLIENT_APP)])
        while True:
            try:
                res = acquire.AcquireTask(request)
            except Exception:  # noqa: BLE001 - the SuperNode's API is not up yet, or restarting
                time.sleep(0.5)
                continue
            if res.HasField("task") and res.token:
                try:
                    self.run_task(res.token)
                except (Exception, RunNotRunningException) as e:  # noqa: BLE001 - the next task still runs
                    print(f"veil executor: task skipped: {type(e).__name__}: {e}"[:300], file=sys.stderr, flush=True)
            else:
                time.sleep(self.poll)

    def app_for(self, run: Any, fab: Any) -> ClientApp:
        """The run's ClientApp, installed from its bundle and imported once per bundle."""
        if fab.hash_str not in self.apps:
            install_from_fab(fab.content, skip_prompt=True)
            load = get_load_client_app_fn(default_app_ref="", app_path=None, multi_app=True)
            self.apps[fab.hash_str] = load(run.fab_id, run.fab_version, fab.hash_str)
        return self.apps[fab.hash_str]

    def run_task(self, token: str) -> None:
        client = self.client(
            RuntimeVersionHttpInterceptor(component_name="flwr-clientapp"), RuntimeTokenHttpInterceptor(token)
        )
        beat = HeartbeatSender(make_task_heartbeat_fn_http(client))
        beat.start()
        context, status, details = None, SubStatus.FAILED, "the ClientApp task failed"
        t = [time.perf_counter()]
        try:
            message, context, run, fab = run_clientapp.pull_task_input(client)
            t.append(time.perf_counter())
            try:
                reply = self.app_for(run, fab)(message=message, context=context)
                status, details = SubStatus.COMPLETED, ""
            except Exception as e:  # noqa: BLE001 - an error reply, as Flower's ClientApp process sends
                details = f"{type(e).__name__}: {e}"[:2000]
                reply = Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=details), reply_to=message)
            if self.tap is not None:
                self.record(message, reply, context)
            t.append(time.perf_counter())
            push_message(client, reply, context)
        finally:
            try:
                push_task_output(client, context, status, details)
            finally:
                beat.stop()
                client.close()
            t.append(time.perf_counter())
            steps = ", ".join(f"{b - a:.2f}" for a, b in zip(t, t[1:]))
            print(f"veil executor: task pull, run, push (s): {steps}", file=sys.stderr, flush=True)

    def record(self, message: Message, reply: Message, context: Any) -> None:
        assert self.tap is not None
        self.count += 1
        stem = self.tap / f"{context.run_id}-{context.node_id}-{self.count:06d}"
        stem.with_suffix(".in").write_bytes(message_to_proto(message).SerializeToString())
        stem.with_suffix(".out").write_bytes(message_to_proto(reply).SerializeToString())
        state = self.tap / f"context-{context.run_id}-{context.node_id}.bin"
        state.write_bytes(context_to_proto(context).SerializeToString())


class _TaskRecorder:
    """A NodeState seen through a proxy that remembers the ids of the tasks it creates."""

    def __init__(self, state: Any) -> None:
        self._state, self.task_ids = state, []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._state, name)

    def create_task(self, *args: Any, **kwargs: Any) -> int | None:
        task_id = self._state.create_task(*args, **kwargs)
        if task_id is not None:
            self.task_ids.append(task_id)
        return task_id


def drop_stale_messages() -> None:
    """Drop a pulled message whose run is no longer RUNNING, with the task made for it.

    Flower 1.42's SuperNode (`_pull_and_store_message`) creates the message's task, stores the
    message and preregisters its objects before it pulls them; when the SuperLink then answers that
    the run is not RUNNING (a SuperLink restarted on its database still holds the killed run's
    next-round messages) it only logs "Ignoring message": the task stays queued with objects that
    never come, and an executor that takes it waits through 500 pull tries before it gives up,
    while the resumed run's messages queue behind it. Here the task is finished (stopped) and the
    message and its objects deleted, as Flower does when a pull fails for another reason."""
    import flwr.supernode.start_client_internal as sci

    original = sci._pull_and_store_message
    if getattr(original, "__veil__", False):
        return

    def pull_and_store(*, state: Any, object_store: Any, receive: Any, **kw: Any) -> int | None:
        recorder, seen = _TaskRecorder(state), {}

        def receive_() -> Any:
            got = receive()
            if got is not None:
                seen["message"] = got[0]
            return got

        out = original(state=recorder, object_store=object_store, receive=receive_, **kw)
        if out is None and "message" in seen and recorder.task_ids:  # stored, then given up: drop it
            for task_id in recorder.task_ids:
                state.finish_task(task_id, sub_status=SubStatus.STOPPED, details="the run is no longer running")
            message_id = seen["message"].metadata.message_id
            state.delete_messages(message_ids=[message_id])
            object_store.delete(message_id)
        return out

    pull_and_store.__veil__ = True  # type: ignore[attr-defined]
    sci._pull_and_store_message = pull_and_store  # type: ignore[assignment]


def runtime_address(args: list[str]) -> str:
    """The SuperNode's Runtime API address from its --host / --port (Flower's defaults otherwise)."""
    host, port = "127.0.0.1", "9094"
    for flag, i in ((a, i) for i, a in enumerate(args) if a in ("--host", "--port")):
        if i + 1 < len(args):
            host, port = (args[i + 1], port) if flag == "--host" else (host, args[i + 1])
    return f"{host}:{port}"


def fast_idle_poll(seconds: float) -> None:
    """Cap the SuperNode's idle wait between pulls from the SuperLink (a 3 s `time.sleep` in 1.42)."""
    import flwr.supernode.start_client_internal as sci

    clock = types.SimpleNamespace(**{k: getattr(time, k) for k in dir(time) if not k.startswith("__")})
    clock.sleep = lambda s: time.sleep(min(float(s), seconds))
    sci.time = clock  # type: ignore[assignment]


def prewarm() -> None:
    """Import torch and veil's ClientApps while the SuperNode connects."""
    with contextlib.suppress(Exception):
        import veil.federated.fedavg.client_app  # noqa: F401
        import veil.federated.split.client_app  # noqa: F401


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m veil.federated.supernode", description=__doc__.split("\n\n")[0])
    p.add_argument("--tap", type=Path, help="write every message and the Context after each under this folder")
    p.add_argument("--poll", type=float, default=0.2, help="the SuperNode's idle poll of the SuperLink (s)")
    p.add_argument("supernode_args", nargs=argparse.REMAINDER, help="-- then flower-supernode's arguments")
    a = p.parse_args(argv)
    rest = a.supernode_args[1:] if a.supernode_args[:1] == ["--"] else a.supernode_args
    if "--isolation" in rest:
        p.error("--isolation is set by this command (process: this process runs the ClientApp)")
    if a.tap is not None:
        a.tap.mkdir(parents=True, exist_ok=True)
    threading.Thread(target=prewarm, daemon=True).start()
    threading.Thread(target=WarmExecutor(runtime_address(rest), a.tap).serve, daemon=True).start()
    fast_idle_poll(a.poll)
    drop_stale_messages()
    quick_pulls()
    from flwr.supernode.cli.flower_supernode import flower_supernode

    sys.argv = ["flower-supernode", *rest, "--isolation", "process"]
    flower_supernode()


if __name__ == "__main__":
    main()
