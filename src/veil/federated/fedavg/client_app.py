"""veil's Flower ClientApp: defended local training on one data partition (Message API).

Handlers (`@app.train()`, `@app.evaluate()`, `@app.query()`):
  query     -> {"info": MetricRecord(partition-id, num-examples)}: the server learns who holds what
  train     <- {"arrays": global weights, "config": {spec, lr, server-round, proximal-mu}}
            -> {"arrays": new weights (fedavg) or the defended gradient (fedsgd),
                "metrics": {num-examples, loss, steps, partition-id, train-seconds [, dp-weight, norm_bit]},
                "receipt": {digest}}     SHA-256 of the batches used: lets an evaluation oracle
                                         outside the server check it re-derived the same batch
  evaluate  <- global weights -> {"metrics": {num-examples, test_accuracy}} on the client's test share

The silo comes from the node config (`partition-id`, and `data-path` for the silo's own data, or
`num-partitions` for a cut of the run's data set: `veil.federated.fedavg.silo`), which Flower's
simulation engine sets and a SuperNode takes from `--node-config`. The defenses run inside
`client_step`; what leaves the client is exactly what they produced — clipped by Flower's
clipping mod when ``federated.dp`` is client-fixed / client-adaptive (`veil.federated.fedavg.dp`).
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.clientapp.mod import adaptiveclipping_mod, fixedclipping_mod
from flwr.clientapp.typing import ClientAppCallable

from veil.errors import VeilError
from veil.federated.fedavg import dp
from veil.federated.fedavg.secagg import secure_mod
from veil.federated.fedavg.silo import node_silo
from veil.federated.fedavg.task import (
    ClientWorld,
    client_world,
    is_packed,
    load_arrays,
    model_arrays,
    reset_defenses,
    silo_world,
    spec_from_text,
    tensors_arrays,
    train_round,
)

app = ClientApp()


def node_world(conf: Any, ctx: Context) -> tuple[ClientWorld, int]:
    """This node's world and partition id: its own silo when its node config names a `data-path`
    (`veil.federated.fedavg.silo`), else its cut of the run's data set (simulation, demos)."""
    text = str(conf["spec"])
    pid, path = node_silo(dict(ctx.node_config), spec_from_text(text).fed.clients)
    if path is None:
        return client_world(text), pid
    if "schema" not in conf:
        raise VeilError("this server sent no data schema; a silo with data-path needs veil's ServerApp")
    return silo_world(text, pid, path, str(conf["schema"])), pid


def _inject_fault(spec_fail: dict, pid: int, rnd: int, timeout: float) -> None:
    """Test hook (`federated.fail`): make one client raise, hang past the timeout, or die."""
    if not spec_fail or int(spec_fail.get("client", -1)) != pid or int(spec_fail.get("round", -1)) != rnd:
        return
    mode = spec_fail.get("mode", "raise")
    if mode == "raise":
        raise RuntimeError(f"injected failure in client {pid}, round {rnd}")
    if mode == "hang":
        time.sleep(float(spec_fail.get("seconds", timeout * 2 + 5)))
        raise RuntimeError(
            f"injected hang in client {pid}, round {rnd}"
        )  # the late reply is an error; the server has moved on
    elif mode == "exit":
        os._exit(17)


@app.query()
def query(msg: Message, ctx: Context) -> Message:
    world, pid = node_world(msg.content["config"], ctx)
    own = int(bool(world.data.meta.get("silo", False)))  # trains on its own data-path
    info = MetricRecord({"partition-id": pid, "num-examples": int(len(world.parts[pid])), "own-data": own})
    return Message(RecordDict({"info": info}), reply_to=msg)


def clipping_mod(msg: Message, ctx: Context, call_next: ClientAppCallable) -> Message:
    """The client's train mod: Flower's fixed / adaptive clipping mod when the run's spec asks for
    client-side clipping, a pass-through otherwise."""
    spec = spec_from_text(str(msg.content["config"]["spec"]))
    kind = spec.fed.dp
    if kind == "client-fixed":
        return fixedclipping_mod(msg, ctx, call_next)
    if kind == "client-adaptive":
        return adaptiveclipping_mod(msg, ctx, call_next)
    if kind == "local":
        return dp.local_mod(spec.fed, spec.cfg.train.seed)(msg, ctx, call_next)
    return call_next(msg, ctx)


@app.train(mods=[secure_mod, clipping_mod])  # SecAgg+ masks what the clipping mod lets out
def train(msg: Message, ctx: Context) -> Message:
    torch.set_num_threads(1)
    conf = msg.content["config"]
    world, pid = node_world(conf, ctx)
    rnd = int(conf["server-round"])
    _inject_fault(world.spec.fed.fail, pid, rnd, world.spec.fed.timeout)
    reset_defenses(world)
    load_arrays(world.model, msg.content["arrays"])
    t0 = time.perf_counter()
    res = train_round(world, pid, rnd, float(conf["lr"]), float(conf.get("proximal-mu", 0.0)))
    seconds = time.perf_counter() - t0  # the local compute (a SuperNode reports its ClientApp's runtime anyway)
    packed = is_packed(msg.content["arrays"])  # reply as the server sent: packed in deployment
    arrays: ArrayRecord = tensors_arrays(res.grads) if res.grads is not None else model_arrays(world.model, packed)
    metrics = MetricRecord(
        {
            "num-examples": res.num_examples,
            "loss": res.loss,
            "steps": res.steps,
            "partition-id": pid,
            "train-seconds": seconds,
            **dp.reply_metrics(world.spec.fed),
        }
    )
    return Message(
        RecordDict({"arrays": arrays, "metrics": metrics, "receipt": ConfigRecord({"digest": res.digest})}),
        reply_to=msg,
    )


@app.evaluate()
def evaluate(msg: Message, ctx: Context) -> Message:
    from veil.training.loop import evaluate as eval_model

    torch.set_num_threads(1)
    world, pid = node_world(msg.content["config"], ctx)
    load_arrays(world.model, msg.content["arrays"])
    silo = world.data.meta.get("silo", False)  # a silo's own test split; else its slice of the shared one
    share = world.data.test if silo else {k: v[pid :: world.spec.fed.clients] for k, v in world.data.test.items()}
    metrics = eval_model(world.model, share, world.spec.cfg.train.eval_batch_size)
    out = MetricRecord({"num-examples": int(len(share["labels"])), **{k: float(v) for k, v in metrics.items()}})
    return Message(RecordDict({"metrics": out}), reply_to=msg)
