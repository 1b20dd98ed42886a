"""What a federated client and the server share: the run spec, partitions, seeded local batches,
the defended local training round, and model <-> Flower `ArrayRecord` conversion.

The server sends the resolved run spec (YAML text) in every message's config; a client builds
its model, data partition and defenses from it once per process (cached) and keeps no other
state between rounds, so a Ray actor, a SuperNode or the in-process grid behave the same.

Seeds: the batches of client `pid` in round `r` are drawn from a generator seeded by
(seed, r, pid). What protects the client — the defenses' noise, the torch RNG (dropout, MJP's
shuffles) — is seeded from a client-held secret the server never sees (`arm_round`,
`veil.federated.client_secret`); with ``federated.secret: seeded`` from (seed, r, pid) instead,
so a round computes the same update wherever and whenever it runs — what makes `--resume` exact.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from flwr.app import ArrayRecord
from torch import Tensor

from veil.build import build_defenses, build_run
from veil.config import RunConfig, from_dict
from veil.data import DataSplits, dirichlet, iid, subset
from veil.defenses.base import Defense
from veil.defenses.noise import torch_seed
from veil.errors import VeilError
from veil.federated.client_secret import round_secret
from veil.federated.fedavg.config import FederatedConfig, federated_config
from veil.federated.fedavg.silo import Schema, load_silo, silo_parts
from veil.federated.sections import SpecText, read_sections, split_sections
from veil.models.base import Batch, VeilModel
from veil.models.lora import base_ref, exchanged_state
from veil.training.loop import make_optimizer
from veil.training.step import client_step


@dataclass
class Spec(SpecText):
    """A resolved federated run: the base config, the federated settings, and the raw mapping."""

    cfg: RunConfig
    fed: FederatedConfig
    raw: dict[str, Any]


def load_spec(path: str | Path | None, overrides: list[str] | None = None) -> Spec:
    """Read a YAML config (or a run folder), apply `key=value` overrides, validate both parts."""
    return spec_from_raw(read_sections(path, overrides))


def spec_from_raw(raw: dict[str, Any]) -> Spec:
    base, extra = split_sections(raw)
    cfg = from_dict(base)
    fed = federated_config(extra.get("federated"))
    resolved = {**cfg.to_dict(), "federated": fed.to_dict()}
    if "split" in extra:
        resolved["split"] = extra["split"]
    return Spec(cfg, fed, resolved)


def spec_from_text(text: str) -> Spec:
    return spec_from_raw(yaml.safe_load(text))


# ---- partitions and batches --------------------------------------------------------------------
def partitions(data: DataSplits, fed: FederatedConfig, seed: int) -> list[np.ndarray]:
    labels = data.train["labels"]
    if fed.partition == "iid":
        return iid(labels, fed.clients, seed=seed)
    return dirichlet(labels, fed.clients, fed.alpha, seed=seed, min_size=2)


def round_seed(seed: int, rnd: int, pid: int) -> int:
    return (seed * 1_000_003 + rnd * 10_007 + pid) % (2**62)


def local_slots(n: int, batch_size: int, seed: int, rnd: int, pid: int, epochs: int, steps: int) -> list[Tensor]:
    """The sample slots (indices into the client's partition, 0..n-1) of each local step of round
    `rnd`: `steps` batches if > 0, else `epochs` passes, each pass in an order drawn from a generator
    seeded by (seed, rnd, pid). Public values only, so the server can derive the schedule too."""
    g = torch.Generator().manual_seed(round_seed(seed, rnd, pid))
    if batch_size < 1:
        raise VeilError(f"batch_size must be at least 1, got {batch_size}")
    out: list[Tensor] = []
    epoch = 0
    while True:
        order = torch.randperm(n, generator=g)  # as `iterate_batches(shuffle=True)` draws it
        for start in range(0, n, batch_size):
            if steps and len(out) >= steps:
                return out
            out.append(order[start : start + batch_size])
        epoch += 1
        if not steps and epoch >= epochs:
            return out


def local_batches(
    split: dict[str, Tensor], batch_size: int, seed: int, rnd: int, pid: int, epochs: int, steps: int
) -> Iterator[Batch]:
    """The client's batches for one round (`local_slots` of its partition)."""
    n = len(next(iter(split.values())))
    for idx in local_slots(n, batch_size, seed, rnd, pid, epochs, steps):
        yield subset(split, idx)


def batch_digest(batches: list[Batch]) -> str:
    """SHA-256 over the batches' tensors: the client's receipt of what it trained on."""
    h = hashlib.sha256()
    for b in batches:
        for k in sorted(b):
            h.update(b[k].detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def round_lr(cfg: RunConfig, fed: FederatedConfig, rnd: int) -> float:
    """Warm-up then cosine decay over rounds (round numbers start at 1; the last round's lr > 0)."""
    warm = max(1, int(round(fed.rounds * cfg.train.warmup)))
    if rnd <= warm:
        return cfg.train.lr * rnd / warm
    t = (rnd - warm) / (fed.rounds - warm + 1)
    return cfg.train.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))


# ---- model <-> ArrayRecord ---------------------------------------------------------------------
PACKED = "veil.packed."  # key prefix of a packed record: one flat array per dtype


def model_arrays(model: torch.nn.Module, packed: bool = False) -> ArrayRecord:
    """The model's weights (with LoRA: its adapters and whatever else trains, never the frozen
    base, `veil.models.lora.exchanged_state`) as a record, one array per tensor, or `packed` into one flat array per
    dtype: the same numbers, but a handful of objects on the wire instead of one per tensor, which
    a SuperLink and its SuperNodes move one HTTP request at a time (deployment sends packed)."""
    state = {k: v.detach().cpu() for k, v in exchanged_state(model).items()}
    return pack(state) if packed else ArrayRecord(state)


def pack(state: dict[str, Tensor]) -> ArrayRecord:
    groups: dict[str, list[Tensor]] = {}
    for v in state.values():
        groups.setdefault(str(v.dtype).removeprefix("torch."), []).append(v.reshape(-1))
    return ArrayRecord({PACKED + k: torch.cat(vs) for k, vs in groups.items()})


def is_packed(arrays: ArrayRecord) -> bool:
    return any(k.startswith(PACKED) for k in arrays)


def unpack(arrays: ArrayRecord, like: dict[str, Tensor]) -> dict[str, Tensor]:
    """name -> tensor of a record (packed or not), shaped and ordered as the state dict `like`."""
    flat = arrays.to_torch_state_dict()
    if not is_packed(arrays):
        return flat
    at: dict[str, int] = {}
    out = {}
    for k, ref in like.items():
        key = PACKED + str(ref.dtype).removeprefix("torch.")
        i = at.get(key, 0)
        out[k] = flat[key][i : i + ref.numel()].reshape(ref.shape)
        at[key] = i + ref.numel()
    return out


def load_arrays(model: torch.nn.Module, arrays: ArrayRecord) -> None:
    load_state(model, unpack(arrays, exchanged_state(model)))


def load_state(model: torch.nn.Module, state: dict[str, Tensor]) -> None:
    """Set the exchanged part of `model` (`exchanged_state`: all of it, or with LoRA every tensor
    but the frozen base) from `state`, which must hold exactly those tensors."""
    if base_ref(model) is None:
        model.load_state_dict(state, strict=True)
        return
    want = exchanged_state(model)
    odd = sorted(set(state) ^ set(want))
    if odd:
        raise VeilError(f"a federated message does not fit the model's adapters (e.g. key '{odd[0]}')")
    model.load_state_dict(state, strict=False)


def tensors_arrays(tensors: dict[str, Tensor]) -> ArrayRecord:
    return ArrayRecord({k: v.detach().cpu().contiguous() for k, v in tensors.items()})


# ---- the client's world, built once per process ------------------------------------------------
@dataclass
class ClientWorld:
    spec: Spec
    model: VeilModel
    data: DataSplits
    defenses: list[Defense]
    parts: list[np.ndarray]
    initial: dict[str, Tensor]  # the seeded initial weights (the cached model is trained in place)


@lru_cache(maxsize=4)
def client_world(spec_text: str) -> ClientWorld:
    """Model, data, defenses and the partition of every client, from the server's spec."""
    spec = spec_from_text(spec_text)
    model, data, defenses = build_run(spec.cfg)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return ClientWorld(spec, model, data, defenses, partitions(data, spec.fed, spec.cfg.train.seed), initial)


@lru_cache(maxsize=4)
def silo_world(spec_text: str, pid: int, path: str, schema_text: str) -> ClientWorld:
    """A silo's world: the run's model (seeded as on every party) fitted to the silo's own data at
    `path` (`veil.federated.fedavg.silo`), which is this client's whole partition `pid`."""
    spec = spec_from_text(spec_text)
    data = load_silo(path, Schema.from_text(schema_text), spec.cfg.train.seed)
    model, data, defenses = build_run(spec.cfg, data)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    parts = silo_parts(len(data.train["labels"]), pid, spec.fed.clients)
    return ClientWorld(spec, model, data, defenses, parts, initial)


def reset_defenses(world: ClientWorld) -> None:
    """Fresh defense objects for each round: a defense's internal counters (noise calls, MJP
    draws) then depend only on (round, client), not on which process served earlier rounds.
    Call before loading the global weights (a defense's own parameters are re-created, then set)."""
    for d in world.defenses:
        d.detach()
    world.defenses = build_defenses(world.spec.cfg)
    for d in world.defenses:
        d.attach(world.model)


def arm_round(world: ClientWorld, rnd: int, pid: int) -> None:
    """Seed the client's privacy randomness for round `rnd`: every defense gets this (round,
    client)'s secret, and the torch RNG (dropout, MJP's shuffles) is reseeded — from the secret,
    or from (seed, round, client) with ``federated.secret: seeded`` (`veil.federated.client_secret`)."""
    seed, mode = world.spec.cfg.train.seed, world.spec.fed.secret
    secret = round_secret(mode, seed, rnd, pid)
    torch.manual_seed(round_seed(seed, rnd, pid) if mode == "seeded" else torch_seed((), secret))
    for d in world.defenses:
        d.secret = secret


def step_key(rnd: int, pid: int, i: int) -> int:
    """A defense's `step` argument, unique per (round, client, local step): noise never repeats."""
    return ((rnd * 1009 + pid) * 4096 + i) % (2**32)


def client_split(world: ClientWorld, pid: int) -> dict[str, Tensor]:
    return subset(world.data.train, world.parts[pid])


class ProximalTerm(Defense):
    """FedProx's client term mu/2 ||w - w_global||^2 (Li et al., MLSys 2020), as an auxiliary loss
    so it enters the one defended client step like any other loss term."""

    name = "fedprox"

    def __init__(self, mu: float, model: VeilModel) -> None:
        super().__init__()
        self.mu = float(mu)
        self.anchor = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}

    def aux_loss(self, model: VeilModel, batch: Batch, logits: Tensor) -> Tensor | None:
        if self.mu == 0.0:
            return None
        sq = sum(((p - self.anchor[n]) ** 2).sum() for n, p in model.named_parameters() if n in self.anchor)
        return 0.5 * self.mu * sq


@dataclass
class LocalResult:
    num_examples: int
    steps: int
    loss: float
    digest: str
    grads: dict[str, Tensor] | None = None  # fedsgd: the exported (defended) gradient


def train_round(world: ClientWorld, pid: int, rnd: int, lr: float, mu: float) -> LocalResult:
    """One round of local training on partition `pid`, through the defended `client_step`."""
    cfg, fed, model = world.spec.cfg, world.spec.fed, world.model
    split = client_split(world, pid)
    arm_round(world, rnd, pid)
    steps = 1 if fed.mode == "fedsgd" else fed.local_steps
    batches = list(local_batches(split, cfg.train.batch_size, cfg.train.seed, rnd, pid, fed.local_epochs, steps))
    defenses = list(world.defenses) + ([ProximalTerm(mu, model)] if mu > 0 else [])
    model.train()
    if fed.mode == "fedsgd":
        res = client_step(model, batches[0], defenses, None, step=step_key(rnd, pid, 0), clip=cfg.train.clip or None)
        return LocalResult(len(batches[0]["labels"]), 1, res.loss, batch_digest(batches), res.grads)
    opt = make_optimizer(model, lr, cfg.train.weight_decay, defenses)
    losses = [
        client_step(model, b, defenses, opt, step=step_key(rnd, pid, i), clip=cfg.train.clip or None, export=False).loss
        for i, b in enumerate(batches)
    ]
    return LocalResult(
        int(sum(len(b["labels"]) for b in batches)), len(batches), float(np.mean(losses)), batch_digest(batches)
    )
