"""veil's Flower ServerApp: rounds of FedAvg / FedProx / FedSGD with checkpoints, resume, central
evaluation, byte accounting and the live privacy auditor.

The round loop is written out (not `Strategy.start`) because a resumed run must start at round
k+1 with the checkpointed weights and server-optimiser state; each round still goes through the
strategy's `configure_train` / `aggregate_train` and the Grid's `send_and_receive`.

RUN_DIR/
  config.yaml             resolved spec (model, data, defense, train, federated)
  metrics.jsonl           {"event": "round", round, test_accuracy, train_loss, clients, failures,
                           bytes_down, bytes_up, seconds [, dp_epsilon, dp_delta, dp_clip]} · {"event": "audit", round, client,
                           attack, psnr, ssim, mse, ...} · {"event": "client_failure", ...}
  checkpoints/            last.safetensors (global model), server_optimizer.safetensors (fedsgd),
                          state.json (written last: the completed round)
  status.json             running | finished | failed (+ reason): how the run ended
  summary.json            test_accuracy, rounds, leakage (last audited round, mean per attack), bytes
                          [, dp: kind, noise, clip, delta, epsilon (`veil.federated.fedavg.dp`)]
  leakage.png             leakage per round beside accuracy
"""

from __future__ import annotations

import json
import shlex
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg, FedProx, Strategy

from veil.attacks import Knowledge
from veil.errors import VeilError
from veil.federated.comm import message_bytes
from veil.federated.fedavg import dp
from veil.federated.fedavg.aggregate_audit import secure_train
from veil.federated.fedavg.auditor import Auditor, BatchOracle, LocalPlan
from veil.federated.fedavg.membership import Membership
from veil.federated.fedavg.silo import Schema
from veil.federated.fedavg.strategy import AuditedStrategy
from veil.federated.fedavg.task import Spec, client_world, load_arrays, load_spec, model_arrays, round_lr
from veil.federated.grid import exchange, quick_pulls
from veil.io import append_events, atomic_write_text, save_model_weights, truncate_events
from veil.training.checkpoint import (
    load_group,
    load_optimizer,
    load_weights,
    optimizer_tensors,
    read_state,
    save_checkpoint,
)
from veil.training.loop import evaluate, make_optimizer


def make_strategy(spec: Spec) -> Strategy:
    """FedAvg / FedProx, behind Flower's DP wrapper when `federated.dp` asks (then weighted uniformly)."""
    common: dict[str, Any] = dict(
        fraction_train=1.0, fraction_evaluate=1.0, min_train_nodes=1, min_evaluate_nodes=1, min_available_nodes=1
    )
    if spec.fed.dp != "none":
        common["weighted_by_key"] = dp.WEIGHT_KEY
    if spec.fed.strategy == "fedprox":
        return dp.wrap_strategy(FedProx(proximal_mu=spec.fed.proximal_mu, **common), spec.fed)
    return dp.wrap_strategy(FedAvg(**common), spec.fed)


class ServerState:
    """Global model, optional server optimiser (fedsgd), and the checkpoint folder."""

    def __init__(self, spec: Spec, run_dir: Path) -> None:
        self.spec, self.dir = spec, run_dir
        self.world = client_world(spec.text())  # server's own copy: model shape, test split, oracle
        import copy

        self.model = copy.deepcopy(self.world.model)
        self.model.load_state_dict(self.world.initial)
        self.opt = (
            make_optimizer(self.model, spec.cfg.train.lr, spec.cfg.train.weight_decay)
            if spec.fed.mode == "fedsgd"
            else None
        )
        self.round, self.seconds = 0, 0.0
        self.ck = run_dir / "checkpoints"
        self.auditor: Auditor | None = None  # its multi-round memory is checkpointed with the model
        self.auditor_state: dict[str, Any] = {}

    def resume(self) -> None:
        state = read_state(self.ck, "round", "seconds", unit="round")
        if state is None:
            return
        load_weights(self.ck, self.model, unit="round")
        if self.opt is not None:
            load_optimizer(self.ck, self.opt, "server_optimizer", state["optimizer"], unit="round")
        self.round, self.seconds = int(state["round"]), float(state["seconds"])
        self.auditor_state = state.get("auditor", {})

    def attach_auditor(self, auditor: Auditor | None) -> None:
        """Give the auditor its checkpointed multi-round memory (resume) and checkpoint it from now on."""
        self.auditor = auditor
        if auditor is not None and auditor.multi and self.round > 0:
            auditor.load_state(load_group(self.ck, "auditor", unit="round", missing_ok=True), self.auditor_state)

    def apply(self, agg: ArrayRecord, lr: float) -> None:
        if self.opt is None:
            load_arrays(self.model, agg)
            return
        grads = agg.to_torch_state_dict()
        for g in self.opt.param_groups:
            g["lr"] = lr
        for n, p in self.model.named_parameters():
            p.grad = grads[n].to(p.dtype) if n in grads else None
        self.opt.step()

    def save(self) -> None:
        """The round's checkpoint as one set: a kill mid-write leaves the previous round whole."""
        state: dict[str, Any] = {"round": self.round, "seconds": self.seconds}
        groups: dict[str, dict[str, torch.Tensor]] = {}
        if self.opt is not None:
            groups["server_optimizer"], state["optimizer"] = optimizer_tensors(self.opt)
        if self.auditor is not None and self.auditor.multi:
            groups["auditor"], state["auditor"] = self.auditor.state_tensors()
        save_checkpoint(self.ck, state, groups, self.model)


def make_auditor(spec: Spec, state: ServerState, oracle: bool, sizes: dict[int, int] | None = None) -> Auditor | None:
    if not spec.fed.audit:
        return None
    w = state.world
    text = "input_ids" in w.data.train
    shape = tuple(w.data.train["input_ids" if text else "pixels"].shape[1:])
    bs = spec.cfg.train.batch_size
    # what veil's harness grants a server (`veil.attacks.harness.knowledge_for`): batch size, input shape,
    # the public tokenizer, each defense's settings by name (adaptive attackers read them); never labels
    know = Knowledge(
        batch_size=bs,
        input_shape=shape,
        seq_len=shape[0] if text else None,
        tokenizer=w.data.meta.get("tokenizer"),
        defense={d.name: d.describe() for d in w.defenses},
        seed=spec.cfg.train.seed,
    )
    # what the server configured for the local training (and the partition sizes the clients told it):
    # the attacks that simulate a client's round (ig-fedavg) read it as Observation.local
    plan = LocalPlan(
        batch_size=bs,
        epochs=spec.fed.local_epochs,
        local_steps=spec.fed.local_steps,
        seed=spec.cfg.train.seed,
        weight_decay=spec.cfg.train.weight_decay,
        clip=spec.cfg.train.clip or None,
        sizes=dict(sizes or {}),
        defenses=list(w.defenses),
    )
    return Auditor(
        state.model,
        spec.fed.audit,
        know,
        spec.fed.mode,
        spec.fed.audit_every,
        spec.fed.audit_clients,
        BatchOracle(w) if oracle else None,
        plan,
    )


def server_main(
    grid: Grid, spec: Spec, run_dir: Path, oracle: bool = True, progress: bool = False, packed: bool = False
) -> dict[str, Any]:
    """Run (or resume) the rounds of `spec` into `run_dir`; returns the summary. RUN_DIR/status.json
    says how the run ended (`running`, `finished`, or `failed` with the reason), for a submitter that
    cannot see the ServerApp's exit status (`flwr run` exits 0 when the ServerApp dies)."""
    torch.set_num_threads(1)
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(run_dir / "config.yaml", spec.text())
    atomic_write_text(run_dir / "status.json", json.dumps({"status": "running"}))
    try:
        summary = _rounds(grid, spec, run_dir, oracle, progress, packed)
    except BaseException as e:
        reason = f"{type(e).__name__}: {e}".splitlines()[0][:500]
        atomic_write_text(run_dir / "status.json", json.dumps({"status": "failed", "reason": reason}))
        raise
    atomic_write_text(run_dir / "status.json", json.dumps({"status": "finished"}))
    return summary


def _rounds(grid: Grid, spec: Spec, run_dir: Path, oracle: bool, progress: bool, packed: bool) -> dict[str, Any]:
    state = ServerState(spec, run_dir)
    state.resume()
    metrics = run_dir / "metrics.jsonl"
    truncate_events(metrics, "round", state.round)  # drop the rounds past the checkpoint
    shared = {"spec": spec.text(), "schema": Schema.of(state.world.data).text()}
    members = Membership(grid, spec.fed.clients, shared, min(spec.fed.timeout, 20.0))
    members.wait_for_all(spec.fed.timeout)
    if oracle and spec.fed.audit and members.own_data:
        raise VeilError(
            f"oracle=true scores reconstructions against the run's data set, but silo(s) "
            f"{', '.join(map(str, sorted(members.own_data)))} train on their own data-path; set oracle=false"
        )
    auditor = make_auditor(spec, state, oracle, members.sizes)
    if auditor is not None and not oracle:
        auditor.evidence = run_dir / "reconstructions"
    state.attach_auditor(auditor)
    strategy = AuditedStrategy(
        make_strategy(spec), members.partition_of(), spec.fed.fraction, spec.cfg.train.seed, auditor
    )
    dp.restore_clip(spec.fed, strategy.inner, metrics)
    while state.round < spec.fed.rounds:
        rnd, t0 = state.round + 1, time.perf_counter()
        lr = round_lr(spec.cfg, spec.fed, rnd)
        members.refresh(rnd)  # rejoined nodes get their silo back; known-dead ones are not sampled
        strategy.partition_of = members.partition_of()
        if not strategy.partition_of:
            raise VeilError(f"round {rnd}: no silo has a live SuperNode; see {metrics}")
        arrays = model_arrays(state.model, packed and spec.fed.secagg is None)
        if spec.fed.secagg is None:
            msgs = list(strategy.configure_train(rnd, arrays, ConfigRecord({**shared, "lr": lr}), grid))
            down = sum(message_bytes(m) for m in msgs)
            replies = exchange(grid, msgs, spec.fed.timeout)
            up = sum(message_bytes(m) for m in replies)
            dp.seed_noise(spec.fed, spec.cfg.train.seed, rnd)
            agg, train_metrics = strategy.aggregate_train(rnd, replies)
            sent, got = len(msgs), sum(not m.has_error() for m in replies)
        else:  # SecAgg+: the server (and its auditor) sees only the sum
            dp.seed_noise(spec.fed, spec.cfg.train.seed, rnd)
            agg, train_metrics, sent, got, down, up = secure_train(
                grid, spec, strategy, rnd, arrays, {**shared, "lr": lr}
            )
        for node in strategy.failed:
            members.mark_dead(node)
        if agg is not None:
            state.apply(agg, lr)
        state.round, state.seconds = rnd, state.seconds + time.perf_counter() - t0
        ev = {
            "event": "round",
            "round": rnd,
            "lr": lr,
            "clients": sent,
            "replies": got,
            "train_loss": float(train_metrics["loss"]) if train_metrics is not None else None,
            "bytes_down": down,
            "bytes_up": up,
            "seconds": round(time.perf_counter() - t0, 3),
            **dp.round_fields(spec.fed, strategy.inner, rnd),
            **evaluate(state.model, state.world.data.test, spec.cfg.train.eval_batch_size),
        }
        events, strategy.events, members.events = members.events + strategy.events + [ev], [], []
        append_events(metrics, events)
        state.save()
        if progress:
            print(
                f"round {rnd}/{spec.fed.rounds}: test_accuracy={ev['test_accuracy']:.4f} loss={ev['train_loss']} ({ev['seconds']:.1f}s)",
                flush=True,
            )
    return finish(spec, state, metrics)


def leakage(events: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Mean of each attack's numeric metrics over the clients of the last audited round."""
    audits = [e for e in events if e.get("event") == "audit" and "skipped" not in e]
    if not audits:
        return {}
    last = max(e["round"] for e in audits)
    per: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for e in audits:
        if e["round"] == last:
            for k, v in e.items():
                if k not in ("round", "client") and isinstance(v, (int, float)) and not isinstance(v, bool):
                    per[e["attack"]][k].append(float(v))
    return {a: {"round": last, **{k: float(np.mean(v)) for k, v in m.items()}} for a, m in per.items()}


def finish(spec: Spec, state: ServerState, metrics: Path) -> dict[str, Any]:
    from veil.federated.fedavg.plots import plot_leakage

    events = [json.loads(ln) for ln in metrics.read_text().splitlines() if ln]
    rounds = [e for e in events if e["event"] == "round"]
    save_model_weights(state.model, state.ck / "model.safetensors")
    summary = {
        "model": spec.cfg.model["name"],
        "data": spec.cfg.data["name"],
        "defense": [d["name"] for d in spec.cfg.defense] or ["none"],
        "mode": spec.fed.mode,
        "strategy": spec.fed.strategy,
        "clients": spec.fed.clients,
        "partition": spec.fed.partition,
        "alpha": spec.fed.alpha,
        "rounds": state.round,
        "train_seconds": round(state.seconds, 3),
        "test_accuracy": rounds[-1]["test_accuracy"] if rounds else None,
        "best_round_accuracy": max((e["test_accuracy"] for e in rounds), default=None),
        "client_failures": sum(e["event"] == "client_failure" for e in events),
        "bytes_total": int(sum(e["bytes_down"] + e["bytes_up"] for e in rounds)),
        "leakage": leakage(events),
    }
    if spec.fed.dp != "none":
        summary["dp"] = dp.summary(spec.fed, state.round)
    atomic_write_text(state.dir / "summary.json", json.dumps(summary, indent=2))
    plot_leakage(events, state.dir / "leakage.png")
    return summary


# ---- `flwr run` / SuperLink entry point -------------------------------------------------------
app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Reads `config` (YAML path), `run-dir` and optional `overrides` (space-separated key=value)
    from the Flower run config (pyproject `[tool.flwr.app.config]` or `--run-config`)."""
    quick_pulls()
    rc = context.run_config
    spec = load_spec(str(rc["config"]), shlex.split(str(rc.get("overrides", ""))))
    run_dir = Path(str(rc.get("run-dir", "runs/flwr")))
    oracle = bool(rc.get("oracle", False))  # a deployment's server has no ground truth (test clients: true)
    server_main(grid, spec, run_dir, oracle=oracle, progress=True, packed=bool(rc.get("packed", True)))
