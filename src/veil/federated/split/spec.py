"""The split-learning run spec (the bottom of `veil.federated.split`): the `split:` section, the
task names, and `SplitSpec` (the resolved config every message carries, so a stateless client
can rebuild its head and tail). Nothing here builds a model or touches data."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from veil.config import RunConfig, coerce_section, from_dict
from veil.errors import VeilError
from veil.federated.client_secret import MODES as SECRET_MODES
from veil.federated.sections import SpecText, check_choices, read_sections, split_sections

#: `split.head_pos`: the head's position embedding, the model's learned table or fixed 2-D sine-cosine
HEAD_POS = ("model", "sincos")
#: the multi-task setting's tasks (`veil.federated.split.multitask` defines each)
TASKS = ("classify", "zones", "segment")


@dataclass
class SplitConfig:
    """The `split:` section (veil split):

    protocol: pfesta        # sl | festa | pfesta | fl | central
    tasks: [classify, zones, segment]
    clients_per_task: 2
    epochs: 20              # passes over each client's shard
    unify_every: 0          # global steps between FedAvg of heads/tails within a task (0: once per epoch)
    task_scale: {}          # per-task gradient scaling at the body, e.g. {classify: 1, zones: 2, segment: 10}
    backend: inline         # inline | ray
    eval_every: 0           # epochs between evaluations (0: only at the end)
    freeze_head: false      # central only: keep the patch-embedding head at its initialisation, as p-FeSTA does
    head_pos: model         # the head's position embedding: model (the ViT's learned table) | sincos (fixed 2-D)
    secret: random          # random: permutation keys also seeded from a client-held secret; seeded: from the run seed
    checkpoint_every: 0     # steps between checkpoints for resume (0: each epoch; fl: each unification)
    """

    protocol: str = "pfesta"
    tasks: list[Any] = field(default_factory=lambda: ["classify", "zones", "segment"])
    clients_per_task: int = 2
    epochs: int = 20
    unify_every: int = 0
    task_scale: dict[str, Any] = field(default_factory=dict)
    backend: str = "inline"
    eval_every: int = 0
    num_cpus: float = 1.0
    freeze_head: bool = False
    head_pos: str = "model"
    secret: str = "random"
    checkpoint_every: int = 0


_SPLIT_CHOICES = {
    "protocol": ("sl", "festa", "pfesta", "fl", "central"),
    "backend": ("inline", "ray"),
    "secret": SECRET_MODES,
    "head_pos": HEAD_POS,
}


def split_config(raw: Any) -> SplitConfig:
    sc = coerce_section(SplitConfig, raw, "split")
    check_choices(sc, "split", _SPLIT_CHOICES)
    bad = [t for t in sc.tasks if t not in TASKS]
    if bad or not sc.tasks:
        raise VeilError(f"split.tasks must be a non-empty list from {', '.join(TASKS)}, got {sc.tasks!r}")
    if sc.clients_per_task < 1 or sc.epochs < 1:
        raise VeilError("split.clients_per_task and split.epochs must be at least 1")
    if sc.checkpoint_every < 0:
        raise VeilError(
            f"split.checkpoint_every must be 0 (each epoch) or a positive number of steps, got {sc.checkpoint_every}"
        )
    return sc


@dataclass
class SplitSpec(SpecText):
    """A resolved split run: the base config, the `split:` settings, and the raw mapping."""

    cfg: RunConfig
    split: SplitConfig
    raw: dict[str, Any]


#: the defenses split learning drives (through `Defense.before_send` / `after_receive`, on the
#: features a client sends): p-FeSTA's permutation module. Gradient defenses act on FedAvg updates.
FEATURE_DEFENSES = ("permutation",)


def check_defenses(cfg: RunConfig, protocol: str) -> None:
    """Split learning takes feature defenses only, and the permutation only under p-FeSTA (Alg. 1:
    cached head features, the body's output un-shuffled by the client that holds the key)."""
    for d in cfg.defense:
        if d["name"] not in FEATURE_DEFENSES:
            raise VeilError(
                f"defense {d['name']!r} does not act on split learning's features; allowed: {', '.join(FEATURE_DEFENSES)}"
            )
        if d["name"] == "permutation" and protocol != "pfesta":
            raise VeilError(
                f"defense 'permutation' is p-FeSTA's module: it needs split.protocol=pfesta, got {protocol}"
            )
    if len(cfg.defense) > 1:
        raise VeilError(f"split learning takes one feature defense, got {len(cfg.defense)}")


def split_spec_from_raw(raw: dict[str, Any]) -> SplitSpec:
    base, extra = split_sections(raw)
    cfg = from_dict(base)
    sc = split_config(extra.get("split"))
    check_defenses(cfg, sc.protocol)
    if cfg.train.lora:  # split learning builds its own head / body / tail from the model's name
        raise VeilError(
            "train.lora is not supported by split learning (it trains head, body and tails whole); remove it"
        )
    split = {**sc.__dict__}
    if split["head_pos"] == "model":  # the default stays out of the text: older run folders still match
        del split["head_pos"]
    return SplitSpec(cfg, sc, {**cfg.to_dict(), "split": split})


def permutes(spec: SplitSpec) -> bool:
    """Whether the clients shuffle their features (the permutation defense is on and enabled)."""
    return any(d["name"] == "permutation" and d.get("enabled", True) for d in spec.cfg.defense)


def split_spec_from_text(text: str) -> SplitSpec:
    return split_spec_from_raw(yaml.safe_load(text))


def load_split_spec(path: str | Path | None, overrides: list[str] | None = None) -> SplitSpec:
    return split_spec_from_raw(read_sections(path, overrides))
