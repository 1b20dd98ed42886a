"""The live privacy auditor: the honest-but-curious server's attacks on the updates it receives.

Before each aggregation (`veil.federated.fedavg.strategy.AuditedStrategy`) the auditor runs the
chosen attacks on the updates the server received — exactly what a curious server could do:

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
deployment no oracle exists: events carry the attack's own statistics and the signals of
`veil.federated.fedavg.evidence`, and the reconstructions are saved to the run folder.
`veil.federated.fedavg.strategy.AuditedStrategy` calls the auditor from the round loop.
"""

from __future__ import annotations

import copy
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, Message

from veil.attacks import Attack, Knowledge, LocalTraining, Observation, Reconstruction, create_attack
from veil.attacks.harness import audit_event
from veil.federated.fedavg import evidence
from veil.federated.fedavg.task import (
    ClientWorld,
    batch_digest,
    client_split,
    load_arrays,
    load_state,
    local_batches,
    local_slots,
    unpack,
)
from veil.models.base import VeilModel
from veil.models.lora import exchanged_state

Score = Callable[[int, int, str, Reconstruction], dict[str, Any]]
#: what the server saw, per view the auditor attacks (`update` of an event)
SERVER_SAW = {
    "mean": "one client's updates, averaged over the rounds it took part in",
    "global-difference": "the difference of two consecutive global models (every sampled client)",
}
#: the views only a server that remembers earlier rounds can offer (`veil.attacks.base.OBSERVES`)
MEMORY = frozenset({"rounds", "aggregate"})


@dataclass
class LocalPlan:
    """What the server configured for every client's local training (it sent the spec) and learnt
    from the clients' `query` replies (partition sizes): enough to rebuild each round's
    `LocalTraining` (`Auditor.local_training`)."""

    batch_size: int
    epochs: int
    local_steps: int
    seed: int
    weight_decay: float
    clip: float | None
    sizes: dict[int, int]  # partition id -> samples
    defenses: list = field(default_factory=list)  # for their lr scales (the groups of the client's AdamW)


class Auditor:
    """Runs attacks on one round's updates; returns one event per (client, attack).

    Attacks that observe "rounds" or "aggregate" (`veil.attacks.base.OBSERVES`) read what the server kept
    across rounds: each client's running sum of pseudo-gradients and how many it holds (`sums`,
    `counts`), and the previous round's global weights, lr, mean steps and participants (`prev`).
    They are part of the server's checkpoint (`state_tensors` / `load_state`), so a resumed run
    attacks the same means."""

    def __init__(
        self,
        model: VeilModel,
        attacks: list[dict[str, Any]],
        know: Knowledge,
        mode: str,
        every: int = 1,
        max_clients: int = 1,
        score: Score | None = None,
        plan: LocalPlan | None = None,
    ) -> None:
        self.model = copy.deepcopy(model)
        self.attacks: list[tuple[str, Attack]] = [
            (a["name"], create_attack(a["name"], **{k: v for k, v in a.items() if k != "name"})) for a in attacks
        ]
        self.know, self.mode, self.every, self.max_clients, self.score, self.plan = (
            know,
            mode,
            every,
            max_clients,
            score,
            plan,
        )
        self.multi = any(a.observes & MEMORY for _, a in self.attacks)
        self.evidence: Path | None = None  # without an oracle: where reconstructions are saved (`evidence`)
        self.sums: dict[int, dict[str, torch.Tensor]] = {}
        self.counts: dict[int, int] = {}
        self.prev: dict[str, Any] | None = None  # {"weights": state dict, "lr", "steps", "pids", "round"}

    def due(self, rnd: int) -> bool:
        return bool(self.attacks) and self.max_clients > 0 and (rnd % self.every == 0 or rnd == 1)

    def local_training(self, rnd: int, pid: int, lr: float, steps: int) -> LocalTraining | None:
        """How client `pid` trained in round `rnd`, from public values only: the configured optimiser
        (veil's AdamW groups, clipping), lr, batch size and epochs, the reply's step count, the
        partition size from its query reply, and the batch schedule seeded by (seed, round, client)
        (`veil.federated.fedavg.task.local_slots`)."""
        from veil.attacks.inverting_fedavg import optimizer_groups

        p = self.plan
        if p is None or pid not in p.sizes:
            return None
        n = int(p.sizes[pid])
        order = local_slots(n, p.batch_size, p.seed, rnd, pid, p.epochs, p.local_steps)
        used = sorted({int(i) for idx in order for i in idx})
        slot = {s: j for j, s in enumerate(used)}  # dummy slots only for samples trained on this round
        return LocalTraining(
            lr=lr,
            steps=steps,
            batch_size=p.batch_size,
            epochs=p.epochs,
            samples=len(used),
            clip=p.clip,
            groups=optimizer_groups(self.model, lr, p.weight_decay, p.defenses),
            order=tuple(tuple(slot[int(i)] for i in idx) for idx in order),
        )

    def pseudo_gradient(
        self, global_arrays: ArrayRecord, reply: Message, lr: float
    ) -> tuple[dict[str, torch.Tensor], int]:
        load_arrays(self.model, global_arrays)
        update = unpack(reply.content["arrays"], exchanged_state(self.model))
        if self.mode == "fedsgd":
            return {k: v.float() for k, v in update.items()}, 1
        steps = max(1, int(reply.content["metrics"]["steps"]))
        return {
            n: (p.detach() - update[n]) / (lr * steps) for n, p in self.model.named_parameters() if p.requires_grad
        }, steps

    def observation(self, rnd: int, global_arrays: ArrayRecord, reply: Message, lr: float) -> Observation:
        grads, steps = self.pseudo_gradient(global_arrays, reply, lr)
        if self.mode == "fedsgd":
            return Observation(self.model, grads, kind="gradient")
        pid = int(reply.content["metrics"]["partition-id"])
        return Observation(self.model, grads, kind="delta", local=self.local_training(rnd, pid, lr, steps))

    def record(self, global_arrays: ArrayRecord, replies: list[Message], lr: float) -> None:
        """Add every reply's pseudo-gradient to its client's running sum (before the round's audit:
        this round counts in the means)."""
        if not self.multi:
            return
        for reply in replies:
            pid = int(reply.content["metrics"]["partition-id"])
            grads, _ = self.pseudo_gradient(global_arrays, reply, lr)
            acc = self.sums.setdefault(pid, {k: torch.zeros_like(v) for k, v in grads.items()})
            for k, v in grads.items():
                acc[k] += v
            self.counts[pid] = self.counts.get(pid, 0) + 1

    def remember(self, rnd: int, global_arrays: ArrayRecord, replies: list[Message], lr: float) -> None:
        """Keep this round's global weights, lr, mean steps and participants (after the round's audit):
        the next round's global-difference view."""
        if not self.multi:
            return
        steps = [max(1, int(r.content["metrics"]["steps"])) for r in replies] or [1]
        self.prev = {
            "weights": {k: v.detach().clone() for k, v in unpack(global_arrays, exchanged_state(self.model)).items()},
            "lr": lr,
            "steps": statistics.fmean(steps),
            "pids": sorted(int(r.content["metrics"]["partition-id"]) for r in replies),
            "round": rnd,
        }

    def mean_update(self, pid: int, global_arrays: ArrayRecord) -> Observation:
        """The client's pseudo-gradients averaged over every round the server received one, at the
        current global weights."""
        load_arrays(self.model, global_arrays)
        k = max(1, self.counts.get(pid, 0))
        grads = {n: v / k for n, v in self.sums.get(pid, {}).items()}
        return Observation(self.model, grads, kind="gradient" if self.mode == "fedsgd" else "delta")

    def global_difference(self, rnd: int, global_arrays: ArrayRecord) -> Observation | None:
        """(w_{r-1} - w_r) / (lr_{r-1} s̄_{r-1}) at w_{r-1}, or None at the first round."""
        if self.prev is None or self.prev["round"] != rnd - 1:
            return None
        now = unpack(global_arrays, exchanged_state(self.model))
        load_state(self.model, self.prev["weights"])
        scale = self.prev["lr"] * (self.prev["steps"] if self.mode != "fedsgd" else 1.0)
        grads = {n: (p.detach() - now[n]) / scale for n, p in self.model.named_parameters() if p.requires_grad}
        return Observation(self.model, grads, kind="gradient" if self.mode == "fedsgd" else "delta")

    def audit(self, rnd: int, global_arrays: ArrayRecord, replies: list[Message], lr: float) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for reply in replies[: self.max_clients]:
            pid = int(reply.content["metrics"]["partition-id"])
            digest = str(reply.content["receipt"]["digest"]) if "receipt" in reply.content else ""
            obs = self.observation(rnd, global_arrays, reply, lr)
            for name, attack in self.attacks:
                if "aggregate" in attack.observes:
                    continue  # the global view is attacked once per round, below
                if "rounds" in attack.observes:
                    view = self.mean_update(pid, global_arrays)
                    ev = self.run(
                        attack,
                        view,
                        {
                            "event": "audit",
                            "round": rnd,
                            "client": pid,
                            "attack": name,
                            "update": "mean",
                            "rounds_averaged": self.counts.get(pid, 0),
                        },
                        lambda rec, p=pid, d=digest: self.score(rnd, p, d, rec) if self.score else {},
                    )
                else:
                    ev = self.run(
                        attack,
                        obs,
                        {"event": "audit", "round": rnd, "client": pid, "attack": name, "update": obs.kind},
                        lambda rec, p=pid, d=digest: self.score(rnd, p, d, rec) if self.score else {},
                    )
                events.append(ev)
        for name, attack in self.attacks:
            if "aggregate" not in attack.observes:
                continue
            ev = {"event": "audit", "round": rnd, "client": "all", "attack": name, "update": "global-difference"}
            view = self.global_difference(rnd, global_arrays)
            if view is None:
                events.append({**ev, "skipped": "no previous global model yet (the first round)"})
                continue
            prev = self.prev
            assert prev is not None
            # one rebuild of the aggregate, scored against each audited client's samples of that round (as every
            # per-client attack is: the same chance level; a pool of every client's images would lift it)
            audited = prev["pids"][: self.max_clients]
            score_one = getattr(self.score, "score_round", None)
            scored: dict[str, Any] = {}
            first = self.run(
                attack, view, {**ev, "of_round": prev["round"]}, lambda rec, box=scored: box.update(rec=rec) or {}
            )
            for pid in audited:
                row = {**first, "client": pid}
                if "rec" in scored and score_one is not None:
                    row.update(score_one(prev["round"], [pid], scored["rec"]))
                events.append(row)
        return events

    def run(
        self, attack: Attack, obs: Observation, ev: dict[str, Any], score: Callable[[Reconstruction], dict[str, Any]]
    ) -> dict[str, Any]:
        """One attack on one view: the event, with its scores, or why it was skipped or failed; its
        threat model too (`server_saw`: which view; `knows`: what the attacker is granted)."""
        ev.setdefault("server_saw", SERVER_SAW.get(str(ev.get("update")), "one client's update"))
        ev.setdefault("knows", str(attack.knows))
        ev, rec = audit_event(attack, obs, self.know, int(ev["round"]), ev, score)
        if (
            rec is not None and self.evidence is not None
        ):  # no ground truth: keep the rebuild and what it says about itself
            ev.update(evidence.signals(rec))
            stem = self.evidence / f"round{int(ev['round']):03d}" / f"client{ev['client']}-{ev['attack']}"
            ev["saved"] = [
                str(Path(p).relative_to(self.evidence.parent)) for p in evidence.save(rec, stem, self.know.tokenizer)
            ]
        return ev

    # ---- checkpoint ----------------------------------------------------------------------------
    def state_tensors(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """(tensors, JSON scalars) of the multi-round memory, for the server's checkpoint."""
        tensors = {f"sum/{pid}/{k}": v.contiguous() for pid, d in self.sums.items() for k, v in d.items()}
        scalars: dict[str, Any] = {"counts": {str(k): v for k, v in self.counts.items()}}
        if self.prev is not None:
            tensors.update({f"prev/{k}": v.contiguous() for k, v in self.prev["weights"].items()})
            scalars["prev"] = {k: v for k, v in self.prev.items() if k != "weights"}
        return tensors, scalars

    def load_state(self, tensors: dict[str, torch.Tensor], scalars: dict[str, Any]) -> None:
        self.counts = {int(k): int(v) for k, v in scalars.get("counts", {}).items()}
        self.sums = {}
        for key, v in tensors.items():
            kind, rest = key.split("/", 1)
            if kind == "sum":
                pid, name = rest.split("/", 1)
                self.sums.setdefault(int(pid), {})[name] = v
        self.prev = None
        if "prev" in scalars:
            self.prev = {
                **scalars["prev"],
                "weights": {k.split("/", 1)[1]: v for k, v in tensors.items() if k.startswith("prev/")},
            }


class BatchOracle:
    """The evaluation channel: re-derives a client's round batches (simulation only) to score a
    reconstruction, and checks them against the client's SHA-256 receipt."""

    def __init__(self, world: ClientWorld) -> None:
        self.world = world

    def batches(self, rnd: int, pid: int) -> list[dict[str, torch.Tensor]]:
        spec = self.world.spec
        steps = 1 if spec.fed.mode == "fedsgd" else spec.fed.local_steps
        return list(
            local_batches(
                client_split(self.world, pid),
                spec.cfg.train.batch_size,
                spec.cfg.train.seed,
                rnd,
                pid,
                spec.fed.local_epochs,
                steps,
            )
        )

    def __call__(self, rnd: int, pid: int, digest: str, rec: Reconstruction) -> dict[str, Any]:
        """`veil.attacks.harness.score` against every distinct sample the client trained on this round
        (images, text — tokens and their bag — and labels alike)."""
        batches = self.batches(rnd, pid)
        return {"verified": batch_digest(batches) == digest, **self.against(batches, rec)}

    def score_round(self, rnd: int, pids: list[int], rec: Reconstruction) -> dict[str, Any]:
        """The score against every distinct sample any of `pids` trained on in round `rnd` (a view of
        the round's aggregate, e.g. the difference of consecutive global models)."""
        return self.against([b for pid in pids for b in self.batches(rnd, pid)], rec)

    def against(self, batches: list[dict[str, torch.Tensor]], rec: Reconstruction) -> dict[str, Any]:
        from veil.attacks.harness import score

        out: dict[str, Any] = {}
        truth = {k: torch.cat([b[k] for b in batches]) for k in batches[0]}
        key = "pixels" if "pixels" in truth else "input_ids"
        _, idx = np.unique(truth[key].flatten(1).numpy(), axis=0, return_index=True)  # epochs repeat samples
        truth = {k: v[np.sort(idx)] for k, v in truth.items()}
        if rec.images is not None:
            rec.images = rec.images.detach().cpu().float().clamp(0, 1)
        out.update({k: float(v) for k, v in score(rec, truth, self.world.data).items() if k != "seconds"})
        return out
