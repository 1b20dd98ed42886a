"""Split learning on Flower (Park et al., p-FeSTA, Fig. 1-2 and Alg. 1): the server's side.

Protocols (`split.protocol`), each over Flower messages (see `client_app` for the types):
  sl      every step: client head features up, body output down, its gradient up, the head
          gradient down; head and tail stay on the client and are never averaged
  festa   SL + FedAvg of head and tail among the clients of a task every `unify_every` steps
  pfesta  frozen shared patch-embedding head; each client sends its head features ONCE, each
          sample permuted with a fresh client-only key; the server caches them and, every step,
          runs the body on a cached batch, sends the output down, gets the tail's gradient up;
          tails averaged within a task every `unify_every` steps (Alg. 1)
  fl      FedAvg baseline: the whole model goes to every client and back every `unify_every`
          steps; body and head averaged over all clients, tails within a task
  central the task's pooled data trained in one place (no messages), the utility reference

The body takes one Adam step per client batch with the gradient scaled by `task_scale[task]`
(the paper's per-task gradient scaling). Bytes are the serialised size of every message.

Resume: every `split.checkpoint_every` steps (0: each epoch; fl: each unification) both sides
checkpoint what they hold (`veil.federated.split.checkpoint`), when every client has a state-dir;
a rerun continues from RUN_DIR/checkpoints to the weights, metrics and byte counts of an
uninterrupted run (checkpoint messages are not protocol traffic and are not counted).
"""

from __future__ import annotations

import json
import math
import random
import shlex
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.serverapp import Grid, ServerApp
from torch import Tensor, nn

from veil.errors import VeilError
from veil.federated.comm import Ledger, array_of, content_bytes, message_bytes, tensor_of
from veil.federated.grid import exchange, quick_pulls, wait_for_nodes
from veil.federated.split.checkpoint import load_server_state, rng_from_json, rng_to_json, save_server_state
from veil.federated.split.comm import paper_cost
from veil.federated.split.models import build_body
from veil.federated.split.multitask import TASK_DEFS, build_parts
from veil.federated.split.spec import SplitSpec, load_split_spec, permutes
from veil.io import atomic_write_text
from veil.training.checkpoint import optimizer_tensors, restore_optimizer


class Exchange:
    """send_and_receive with byte accounting (train vs eval) and error surfacing."""

    def __init__(self, grid: Grid, spec: SplitSpec) -> None:
        self.grid, self.spec = grid, spec
        self.train, self.eval = Ledger(), Ledger()

    def __call__(self, node: int, mtype: str, phase: str = "train", **records: Any) -> Message:
        conf = records.pop("config", {})
        content = RecordDict({**records, "config": ConfigRecord({"spec": self.spec.text(), **conf})})
        msg = Message(content, dst_node_id=node, message_type=mtype)
        ledger = None if phase == "control" else self.train if phase == "train" else self.eval
        if ledger is not None:
            ledger.sent(msg, message_bytes(msg) - _spec_bytes(self.spec))
        reply = exchange(self.grid, [msg], 600)
        if not reply or reply[0].has_error():
            raise VeilError(
                f"split client {node} failed on {mtype}: {reply[0].error.reason[:300] if reply else 'no reply'}"
            )
        if ledger is not None:
            ledger.received(reply[0])
        return reply[0]


def _spec_bytes(spec: SplitSpec) -> int:
    """The run spec rides along in every message for stateless clients; it is not protocol traffic."""
    return content_bytes(RecordDict({"config": ConfigRecord({"spec": spec.text()})})) - content_bytes(
        RecordDict({"config": ConfigRecord({})})
    )


def _ledger_state(ledger: Ledger) -> dict[str, dict[str, int]]:
    return {"down": dict(ledger.down), "up": dict(ledger.up), "count": dict(ledger.count)}


def _ledger_from(data: dict[str, dict[str, int]]) -> Ledger:
    out = Ledger()
    for part in ("down", "up", "count"):
        getattr(out, part).update({k: int(v) for k, v in data[part].items()})
    return out


class SplitServer:
    def __init__(self, grid: Grid, spec: SplitSpec, run_dir: Path | None = None) -> None:
        """The server builds its body from the public spec; it holds no client data or key."""
        self.spec, self.sc = spec, spec.split
        self.body = build_body(spec)
        self.opt = torch.optim.Adam(self.body.parameters(), lr=spec.cfg.train.lr)
        self.ex = Exchange(grid, spec)
        nodes = wait_for_nodes(grid, len(self.sc.tasks) * self.sc.clients_per_task)
        infos = {n: self.ex(n, "query.info", phase="setup").content["info"] for n in nodes}
        self.pid = {n: int(i["partition-id"]) for n, i in infos.items()}
        self.nodes = sorted(nodes, key=self.pid.get)
        self.task = {n: str(infos[n]["task"]) for n in self.nodes}
        self.size = {n: int(infos[n]["num-examples"]) for n in self.nodes}
        bs = spec.cfg.train.batch_size
        self.steps_per_epoch = max(math.ceil(s / bs) for s in self.size.values())
        self.total = self.sc.epochs * self.steps_per_epoch
        self.unify = self.sc.unify_every or self.steps_per_epoch
        self.events: list[dict[str, Any]] = []
        # resumable when every client keeps its own state (a state-dir in its node config)
        self.ck = run_dir / "checkpoints" if run_dir is not None else None
        if not all(int(infos[n].get("checkpoint", 0)) for n in self.nodes):
            self.ck = None
        self.every = self.sc.checkpoint_every or (self.unify if self.sc.protocol == "fl" else self.steps_per_epoch)
        self.done = 0  # steps completed (restored on resume)
        self.resumed: dict[str, Any] = {}

    # ---- checkpoints (`veil.federated.split.checkpoint`) -------------------------------------
    def checkpoint(self, done: int, loop: dict[str, Any], tensors: dict[str, dict[str, Tensor]]) -> None:
        """Every client writes its state for step `done`, then the server writes its own (state.json last)."""
        if self.ck is None:
            return
        for n in self.nodes:
            self.ex(n, "train.checkpoint", phase="control", config={"step": done})
        groups = {
            "body": self.body.state_dict(),
            "rng": {"torch": torch.get_rng_state()},
            **tensors,
        }
        opt_tensors, opt_scalars = optimizer_tensors(self.opt)
        if opt_tensors:
            groups["optimizer"] = opt_tensors
        state = {
            "step": done,
            "optimizer": opt_scalars,
            "events": self.events,
            "bytes": {"train": _ledger_state(self.ex.train), "eval": _ledger_state(self.ex.eval)},
            "loop": loop,
        }
        save_server_state(self.ck, groups, state)

    def resume(self) -> None:
        """Restore the server's side from RUN_DIR/checkpoints and have every client restore its own."""
        got = load_server_state(self.ck) if self.ck is not None else None
        if got is None:
            return
        state, groups = got
        self.done = int(state["step"])
        self.body.load_state_dict(groups["body"])
        restore_optimizer(self.opt, groups.get("optimizer", {}), state["optimizer"])
        self.events = list(state["events"])
        self.ex.train, self.ex.eval = _ledger_from(state["bytes"]["train"]), _ledger_from(state["bytes"]["eval"])
        for n in self.nodes:
            self.ex(n, "train.restore", phase="control", config={"step": self.done})
        torch.set_rng_state(groups["rng"]["torch"])  # after the clients' (one process in simulation)
        self.resumed = {"loop": state["loop"], "tensors": groups}

    def due(self, done: int) -> bool:
        return done % self.every == 0 or done == self.total

    def scale(self, node: int) -> float:
        return float(self.sc.task_scale.get(self.task[node], 1.0))

    def body_step(self, node: int, h: Tensor, **tail_conf: Any) -> tuple[Tensor | None, float]:
        """Body forward, tail round trip, body backward (scaled) and step; returns dL/dh."""
        h = h.requires_grad_(self.sc.protocol != "pfesta")
        b = self.tokens_for(node, self.body(h))
        rep = self.ex(node, "train.tail", body=array_of(b), config=tail_conf)
        self.opt.zero_grad()
        b.backward(tensor_of(rep, "grad") * self.scale(node))
        self.opt.step()
        return h.grad, float(rep.content["metrics"]["loss"])

    def tokens_for(self, node: int, b: Tensor) -> Tensor:
        """Only what the task's tail reads goes down: [CLS] alone for classification/regression."""
        return b if TASK_DEFS[self.task[node]].reads_patches else b[:, :1]

    def unify_params(self, head: bool) -> None:
        """FedAvg of tails (and heads) among the clients of each task, weighted by data size."""
        by_task: dict[str, list[int]] = defaultdict(list)
        for n in self.nodes:
            by_task[self.task[n]].append(n)
        for nodes in by_task.values():
            if len(nodes) < 2:
                continue
            got = [self.ex(n, "query.params", config={"head": head}) for n in nodes]
            w = torch.tensor([float(self.size[n]) for n in nodes])
            w = w / w.sum()
            sds = [g.content["params"].to_torch_state_dict() for g in got]
            avg = {k: sum(wi * sd[k].float() for wi, sd in zip(w, sds)) for k in sds[0]}
            for n in nodes:
                self.ex(n, "train.params", params=ArrayRecord(avg))

    def train_split(self) -> None:
        pf = self.sc.protocol == "pfesta"
        rng = random.Random(self.spec.cfg.train.seed)
        order: dict[int, list[int]] = {n: [] for n in self.nodes}
        if self.resumed:  # the cached features, the sampling stream and each client's queue, by partition
            loop, tensors = self.resumed["loop"], self.resumed["tensors"]
            cache = {n: tensors["cache"][str(self.pid[n])] for n in self.nodes} if pf else {}
            rng.setstate(rng_from_json(loop["rng"]))
            order = {n: [int(i) for i in loop["order"][str(self.pid[n])]] for n in self.nodes}
        else:
            cache = {n: tensor_of(self.ex(n, "train.embed"), "features") for n in self.nodes} if pf else {}
        for step in range(self.done, self.total):
            losses = []
            for n in self.nodes:
                if pf:
                    if not order[n]:
                        order[n] = rng.sample(range(self.size[n]), self.size[n])
                    idx, order[n] = (
                        order[n][: self.spec.cfg.train.batch_size],
                        order[n][self.spec.cfg.train.batch_size :],
                    )
                    _, loss = self.body_step(n, cache[n][idx].clone(), idx=idx)
                else:
                    h = tensor_of(self.ex(n, "train.fwd", config={"step": step}), "features")
                    gh, loss = self.body_step(n, h, step=step)
                    self.ex(n, "train.bwd", grad=array_of(gh), config={"step": step})
                losses.append(loss)
            if (step + 1) % self.unify == 0 and self.sc.protocol in ("festa", "pfesta"):
                self.unify_params(head=self.sc.protocol == "festa")
            self.log_step(step, losses)
            if self.due(step + 1):
                loop = {"rng": rng_to_json(rng.getstate()), "order": {str(self.pid[n]): order[n] for n in self.nodes}}
                self.checkpoint(step + 1, loop, {"cache": {str(self.pid[n]): cache[n] for n in cache}} if pf else {})

    def train_fl(self) -> None:
        parts = {t: build_parts(self.spec, t) for t in self.sc.tasks}
        glob = {f"head.{k}": v for k, v in parts[self.sc.tasks[0]][0].state_dict().items()}
        glob.update({f"body.{k}": v for k, v in self.body.state_dict().items()})
        tails = {t: {f"tail.{k}": v for k, v in parts[t][1].state_dict().items()} for t in self.sc.tasks}
        if self.resumed:  # the global head + body and each task's tail after the last checkpointed window
            tensors = self.resumed["tensors"]
            glob = dict(tensors["global"])
            tails = {
                t: {k[len(t) + 1 :]: v for k, v in tensors["tails"].items() if k.startswith(t + "/")} for t in tails
            }
        for start in range(self.done, self.total, self.unify):
            steps = min(self.unify, self.total - start)
            reps = {
                n: self.ex(
                    n,
                    "train.local",
                    params=ArrayRecord({**glob, **tails[self.task[n]]}),
                    config={"step": start, "steps": steps, "lr": self.spec.cfg.train.lr},
                )
                for n in self.nodes
            }
            sds = {n: r.content["params"].to_torch_state_dict() for n, r in reps.items()}
            glob = _wavg([sds[n] for n in self.nodes], [self.size[n] for n in self.nodes], ("head.", "body."))
            for t in self.sc.tasks:
                ns = [n for n in self.nodes if self.task[n] == t]
                tails[t] = _wavg([sds[n] for n in ns], [self.size[n] for n in ns], ("tail.",))
            self.log_step(start + steps - 1, [float(r.content["metrics"]["loss"]) for r in reps.values()])
            if self.due(start + steps) or (start + steps) % self.every < steps:
                flat = {f"{t}/{k}": v for t, sd in tails.items() for k, v in sd.items()}
                self.checkpoint(start + steps, {}, {"global": glob, "tails": flat})
        self.body.load_state_dict({k[5:]: v for k, v in glob.items() if k.startswith("body.")})
        for n in self.nodes:  # the final tails and head are the clients' models for evaluation
            self.ex(
                n,
                "train.params",
                params=ArrayRecord({**{k: v for k, v in glob.items() if k.startswith("head.")}, **tails[self.task[n]]}),
            )

    def log_step(self, step: int, losses: list[float]) -> None:
        if (step + 1) % self.steps_per_epoch == 0:
            self.events.append(
                {
                    "event": "epoch",
                    "epoch": (step + 1) // self.steps_per_epoch,
                    "step": step + 1,
                    "loss": sum(losses) / len(losses),
                    "bytes": self.ex.train.total(),
                }
            )

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Each task's metric on its test split, through its first client (head, body, tail)."""
        out: dict[str, float] = {}
        for t in self.sc.tasks:
            n = next(n for n in self.nodes if self.task[n] == t)
            h = tensor_of(self.ex(n, "evaluate.embed", phase="eval", config={"protocol": self.sc.protocol}), "features")
            rep = self.ex(
                n,
                "evaluate.tail",
                phase="eval",
                body=array_of(self.tokens_for(n, self.body.eval()(h))),
                config={"protocol": self.sc.protocol},
            )
            self.body.train()
            out[t] = float(next(iter(rep.content["metrics"].values())))
        return out


def _wavg(sds: list[dict[str, Tensor]], sizes: list[int], prefixes: tuple[str, ...]) -> dict[str, Tensor]:
    w = torch.tensor(sizes, dtype=torch.float64)
    w = w / w.sum()
    keys = [k for k in sds[0] if k.startswith(prefixes)]
    return {k: sum(float(wi) * sd[k].double() for wi, sd in zip(w, sds)).float() for k in keys}


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


def split_summary(spec: SplitSpec) -> dict[str, Any]:
    """The head of a split run's summary: what was run."""
    return {
        "protocol": spec.split.protocol,
        "freeze_head": spec.split.freeze_head,
        "tasks": list(spec.split.tasks),
        "permute": permutes(spec),
        "clients_per_task": spec.split.clients_per_task,
        "epochs": spec.split.epochs,
        "metric_names": {t: TASK_DEFS[t].metric_name for t in spec.split.tasks},
    }


def server_main(grid: Grid, spec: SplitSpec, run_dir: Path) -> dict[str, Any]:
    """Train and evaluate one split protocol over `grid`; RUN_DIR/metrics.jsonl gets the epochs.
    Returns the task metrics, the measured bytes and the paper's per-client costs."""
    server = SplitServer(grid, spec, run_dir)
    server.resume()
    server.train_fl() if spec.split.protocol == "fl" else server.train_split()
    out: dict[str, Any] = {"metrics": server.evaluate()}
    out.update(
        {
            "bytes": server.ex.train.as_dict(),
            "bytes_per_client": server.ex.train.total() / len(server.nodes),
            "eval_bytes": server.ex.eval.total(),
            "paper_bytes_per_client": paper_table(server),
            "steps": server.total,
            "unify_every": server.unify,
        }
    )
    with (run_dir / "metrics.jsonl").open("w") as f:
        for e in server.events:
            f.write(json.dumps(e) + "\n")
    return out


# ---- `flwr run` / SuperLink entry point -------------------------------------------------------
app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Split learning under a SuperLink: reads `config` (YAML path), `run-dir` and optional
    `overrides` from the Flower run config; one SuperNode per client (`partition-id` in its node
    config: task-major, as `veil.federated.split.multitask.multitask_data` orders them). The server
    holds the body only; each client's head, tail and permutation keys stay in its SuperNode
    (`veil.federated.supernode`: the Context lives there). RUN_DIR/status.json says how the run ended."""
    quick_pulls()
    rc = context.run_config
    spec = load_split_spec(str(rc["config"]), shlex.split(str(rc.get("overrides", ""))))
    if spec.split.protocol == "central":
        raise VeilError("split.protocol=central trains in one place; run it with veil split, not over a SuperLink")
    run_dir = Path(str(rc.get("run-dir", "runs/flwr-split")))
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(run_dir / "config.yaml", spec.text())
    atomic_write_text(run_dir / "status.json", json.dumps({"status": "running"}))
    t0 = time.perf_counter()
    torch.set_num_threads(1)
    try:
        summary = {**split_summary(spec), **server_main(grid, spec, run_dir)}
    except BaseException as e:
        reason = f"{type(e).__name__}: {e}".splitlines()[0][:500]
        atomic_write_text(run_dir / "status.json", json.dumps({"status": "failed", "reason": reason}))
        raise
    summary["seconds"] = round(time.perf_counter() - t0, 2)
    atomic_write_text(run_dir / "summary.json", json.dumps(summary, indent=2))
    atomic_write_text(run_dir / "status.json", json.dumps({"status": "finished"}))
    print(json.dumps(summary["metrics"]), flush=True)
