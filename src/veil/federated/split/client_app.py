"""The split-learning ClientApp (SL, FeSTA, p-FeSTA, FL): head and tail on the client, Flower
messages to and from the server's body. Custom message types (Flower's "<category>.<action>"):

  query.info      -> {task, num-examples}                     who holds which task
  train.embed     -> permuted head features of every local sample, sent ONCE (p-FeSTA)
  train.fwd       -> head features of this step's batch (SL / FeSTA)
  train.tail      <- body output; -> gradient w.r.t. it         the tail's forward/backward
  train.bwd       <- gradient w.r.t. the head features          the head's backward (SL / FeSTA)
  query.params    -> head/tail weights                           for FedAvg within a task
  train.params    <- averaged head/tail weights
  train.local     <- full model; -> trained full model           FL baseline
  train.checkpoint <- step; the client writes its Context.state to its own `state-dir` (resume)
  train.restore   <- step; the client loads that snapshot back into its Context.state
  evaluate.embed / evaluate.tail                                 the same exchange on the test split

Client state (head, tail, Adam moments, permutation keys) lives in Flower's per-node
`Context.state`, so it survives across messages whichever process serves them (Ray actors are
pooled). The permutation keys are written there and nowhere else: no reply carries them. A client whose
node config names a `state-dir` (its own folder) can checkpoint that state there and restore it
(`veil.federated.split.checkpoint`), which makes the run resumable.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from torch import Tensor, nn

from veil.defenses import Defense, create_defense
from veil.errors import VeilError
from veil.federated.client_secret import client_secret
from veil.federated.comm import array_of, tensor_of
from veil.federated.split.checkpoint import load_client_state, save_client_state
from veil.federated.split.models import build_body
from veil.federated.split.multitask import TASK_DEFS, SplitWorld, Task, build_parts, split_world
from veil.federated.split.spec import SplitSpec
from veil.training.checkpoint import optimizer_tensors, restore_optimizer

app = ClientApp()


class ClientState:
    """Head + tail (+ their Adam states) loaded from / saved to `Context.state`."""

    def __init__(self, world: SplitWorld, ctx: Context) -> None:
        self.world, self.ctx = world, ctx
        self.pid = int(ctx.node_config["partition-id"])
        self.task_name, self.data = world.clients[self.pid]
        self.task: Task = TASK_DEFS[self.task_name]
        self.head, self.tail = build_parts(world.spec, self.task_name)
        lr = world.spec.cfg.train.lr
        self.opt_head = torch.optim.Adam(self.head.parameters(), lr=lr)
        self.opt_tail = torch.optim.Adam(self.tail.parameters(), lr=lr)
        self.defenses = client_defenses(world.spec, self.pid)
        st = ctx.state
        for key, mod, opt in (("head", self.head, self.opt_head), ("tail", self.tail, self.opt_tail)):
            if key in st.array_records:
                mod.load_state_dict(st[key].to_torch_state_dict())
            if f"opt-{key}" in st.array_records:
                restore_optimizer(
                    opt, st[f"opt-{key}"].to_torch_state_dict(), json.loads(str(st[f"opt-{key}-meta"]["json"]))
                )

    def save(self) -> None:
        st = self.ctx.state
        for key, mod, opt in (("head", self.head, self.opt_head), ("tail", self.tail, self.opt_tail)):
            st[key] = ArrayRecord({k: v.detach().clone() for k, v in mod.state_dict().items()})
            tensors, scalars = optimizer_tensors(opt)
            if tensors:
                st[f"opt-{key}"] = ArrayRecord(tensors)
                st[f"opt-{key}-meta"] = ConfigRecord({"json": json.dumps(scalars)})

    def batch(self, step: int) -> dict[str, Tensor]:
        """This client's batch at global step `step`: seeded shuffle per epoch."""
        bs = self.world.spec.cfg.train.batch_size
        n = len(self.data["target"])
        per = -(-n // bs)
        epoch, pos = divmod(step, per)
        g = torch.Generator().manual_seed(self.world.spec.cfg.train.seed * 7919 + self.pid * 104729 + epoch)
        idx = torch.randperm(n, generator=g)[pos * bs : (pos + 1) * bs]
        return {k: v[idx] for k, v in self.data.items()}

    def keys(self, name: str) -> Tensor:
        return self.ctx.state[name].to_torch_state_dict()["keys"]

    def send(self, h: Tensor, key_name: str) -> Tensor:
        """Features leaving the client, through its feature defenses (`Defense.before_send`; p-FeSTA:
        permuted per sample with fresh keys). The defense's state (keys, draw counter) goes to
        `Context.state` under `key_name` and nowhere else."""
        if not self.defenses:
            return h
        st = self.ctx.state
        state: dict[str, Any] = {"calls": int(st["perm-calls"]["n"]) if "perm-calls" in st.config_records else 0}
        for d in self.defenses:
            h = d.before_send(h, state)
        if "keys" in state:
            st[key_name] = ArrayRecord({"keys": state["keys"]})
        st["perm-calls"] = ConfigRecord({"n": int(state["calls"])})
        return h

    def receive(self, b: Tensor, key_name: str, idx: Tensor | None = None) -> Tensor:
        """The body's output back on the client, through `Defense.after_receive` with the keys of the
        samples it holds (`idx`: the cached ones the server picked). A tail that reads only [CLS]
        gets nothing to un-shuffle. Autograd through it re-shuffles the gradient going up."""
        if not self.defenses or not self.task.reads_patches or key_name not in self.ctx.state.array_records:
            return b
        keys = self.keys(key_name)
        state: dict[str, Any] = {"keys": keys if idx is None else keys[idx]}
        for d in reversed(self.defenses):
            b = d.after_receive(b, state)
        return b


def client_defenses(spec: SplitSpec, pid: int) -> list[Defense]:
    """The spec's feature defenses for client `pid` (`veil.federated.split.spec.FEATURE_DEFENSES`):
    seeded per client, and with `split.secret: random` mixed with a secret only this process
    holds (`client_secret`), so the server cannot re-derive the keys from the seed."""
    out = []
    for entry in spec.cfg.defense:
        d = create_defense(entry["name"], **{k: v for k, v in entry.items() if k != "name"})
        d.seed = (spec.cfg.train.seed + d.seed) * 1009 + pid
        if spec.split.secret == "random":
            d.secret = client_secret(pid)
        out.append(d)
    return out


def _reply(msg: Message, **records: Any) -> Message:
    return Message(RecordDict(records), reply_to=msg)


def _state(msg: Message, ctx: Context) -> ClientState:
    torch.set_num_threads(1)
    return ClientState(split_world(str(msg.content["config"]["spec"])), ctx)


@app.query("info")
def info(msg: Message, ctx: Context) -> Message:
    cs = _state(msg, ctx)
    return _reply(
        msg,
        info=ConfigRecord(
            {
                "task": cs.task_name,
                "partition-id": cs.pid,
                "num-examples": len(cs.data["target"]),
                "checkpoint": int("state-dir" in ctx.node_config),
            }
        ),
    )


def _state_dir(ctx: Context) -> Path:
    if "state-dir" not in ctx.node_config:
        raise VeilError("this client has no state-dir in its node config, so it cannot checkpoint its state")
    return Path(str(ctx.node_config["state-dir"]))


@app.train("checkpoint")
def checkpoint(msg: Message, ctx: Context) -> Message:
    """Write this client's Context.state (head, tail, Adam, keys) to its own state-dir."""
    conf = msg.content["config"]
    save_client_state(ctx.state, _state_dir(ctx), int(conf["step"]), str(conf["spec"]))
    return _reply(msg, metrics=MetricRecord({"ok": 1}))


@app.train("restore")
def restore(msg: Message, ctx: Context) -> Message:
    """Load the snapshot of `step` from this client's state-dir back into its Context.state."""
    conf = msg.content["config"]
    ctx.state = load_client_state(_state_dir(ctx), int(conf["step"]), str(conf["spec"]))
    return _reply(msg, metrics=MetricRecord({"ok": 1}))


@app.train("embed")
def embed(msg: Message, ctx: Context) -> Message:
    cs = _state(msg, ctx)
    with torch.no_grad():
        h = cs.head(cs.data["pixels"])
    return _reply(msg, features=array_of(cs.send(h, "keys")))


@app.evaluate("embed")
def eval_embed(msg: Message, ctx: Context) -> Message:
    cs = _state(msg, ctx)
    pixels = cs.world.tests[cs.task_name]["pixels"]
    with torch.no_grad():
        h = cs.head(pixels)
    pfesta = str(msg.content["config"]["protocol"]) == "pfesta"
    return _reply(msg, features=array_of(cs.send(h, "test-keys") if pfesta else h))


@app.train("fwd")
def fwd(msg: Message, ctx: Context) -> Message:
    cs = _state(msg, ctx)
    with torch.no_grad():
        h = cs.head(cs.batch(int(msg.content["config"]["step"]))["pixels"])
    return _reply(msg, features=array_of(h))


@app.train("tail")
def tail(msg: Message, ctx: Context) -> Message:
    """Un-permute the body output, tail forward + loss + backward, Adam step, gradient back (re-permuted)."""
    cs = _state(msg, ctx)
    conf = msg.content["config"]
    body = tensor_of(msg, "body").requires_grad_(True)
    if "idx" in conf:  # p-FeSTA: the server picked cached samples by position
        idx = torch.tensor(list(conf["idx"]), dtype=torch.long)
        batch, b = {k: v[idx] for k, v in cs.data.items()}, cs.receive(body, "keys", idx)
    else:
        batch, b = cs.batch(int(conf["step"])), body
    loss = cs.task.loss(cs.tail(b), batch["target"])
    cs.opt_tail.zero_grad()
    loss.backward()
    cs.opt_tail.step()
    cs.save()
    return _reply(msg, grad=array_of(body.grad), metrics=MetricRecord({"loss": float(loss.detach())}))


@app.train("bwd")
def bwd(msg: Message, ctx: Context) -> Message:
    cs = _state(msg, ctx)
    h = cs.head(cs.batch(int(msg.content["config"]["step"]))["pixels"])
    cs.opt_head.zero_grad()
    h.backward(tensor_of(msg, "grad"))
    cs.opt_head.step()
    cs.save()
    return _reply(msg, metrics=MetricRecord({"ok": 1}))


@app.query("params")
def params(msg: Message, ctx: Context) -> Message:
    cs = _state(msg, ctx)
    parts = {f"tail.{k}": v for k, v in cs.tail.state_dict().items()}
    if bool(msg.content["config"]["head"]):
        parts.update({f"head.{k}": v for k, v in cs.head.state_dict().items()})
    return _reply(
        msg,
        params=ArrayRecord({k: v.detach() for k, v in parts.items()}),
        metrics=MetricRecord({"num-examples": len(cs.data["target"])}),
    )


@app.train("params")
def set_params(msg: Message, ctx: Context) -> Message:
    cs = _state(msg, ctx)
    sd = msg.content["params"].to_torch_state_dict()
    cs.tail.load_state_dict({k[5:]: v for k, v in sd.items() if k.startswith("tail.")})
    if any(k.startswith("head.") for k in sd):
        cs.head.load_state_dict({k[5:]: v for k, v in sd.items() if k.startswith("head.")})
    cs.save()
    return _reply(msg, metrics=MetricRecord({"ok": 1}))


@app.evaluate("tail")
def eval_tail(msg: Message, ctx: Context) -> Message:
    cs = _state(msg, ctx)
    test = cs.world.tests[cs.task_name]
    body = tensor_of(msg, "body")
    pfesta = str(msg.content["config"]["protocol"]) == "pfesta"
    with torch.no_grad():
        out = cs.tail(cs.receive(body, "test-keys") if pfesta else body)
    return _reply(msg, metrics=MetricRecord({cs.task.metric_name: cs.task.metric(out, test["target"])}))


@app.train("local")
def local(msg: Message, ctx: Context) -> Message:
    """FL baseline: the whole model (head, body, tail) trained locally for `steps` steps."""
    cs = _state(msg, ctx)
    conf = msg.content["config"]
    body = build_body(cs.world.spec)
    sd = msg.content["params"].to_torch_state_dict()
    for prefix, mod in (("head.", cs.head), ("body.", body), ("tail.", cs.tail)):
        mod.load_state_dict({k[len(prefix) :]: v for k, v in sd.items() if k.startswith(prefix)})
    mods = nn.ModuleDict({"head": cs.head, "body": body, "tail": cs.tail})
    opt = torch.optim.Adam(mods.parameters(), lr=float(conf["lr"]))
    start, steps = int(conf["step"]), int(conf["steps"])
    for s in range(start, start + steps):
        batch = cs.batch(s)
        loss = cs.task.loss(cs.tail(body(cs.head(batch["pixels"]))), batch["target"])
        opt.zero_grad()
        loss.backward()
        opt.step()
    out = {f"{n}.{k}": v.detach().clone() for n, m in mods.items() for k, v in m.state_dict().items()}
    return _reply(
        msg,
        params=ArrayRecord(out),
        metrics=MetricRecord({"num-examples": len(cs.data["target"]), "loss": float(loss.detach())}),
    )
