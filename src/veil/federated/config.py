"""The `federated:` and `split:` sections of a run config (read beside model/data/defense/train).

    federated:
      clients: 10            # SuperNodes, one data partition each
      rounds: 30
      partition: dirichlet   # iid | dirichlet
      alpha: 0.5             # Dirichlet concentration (label skew)
      mode: fedavg           # fedavg: clients return weights after local training
                             # fedsgd: one local step, clients return the (defended) gradient
      local_epochs: 1        # fedavg: passes over the local partition per round
      local_steps: 0         # fedavg: if > 0, exactly this many steps instead of epochs
      strategy: fedavg       # fedavg | fedprox (Flower's `flwr.serverapp.strategy`)
      proximal_mu: 0.0       # FedProx: mu/2 ||w - w_global||^2 on the client
      fraction: 1.0          # clients sampled per round
      audit: []              # attacks the curious server runs on the updates: [april, {name: ig, iterations: 200}]
      audit_every: 1         # audit every k-th round
      audit_clients: 1       # clients audited per audited round (first sampled, by partition id)
      timeout: 600           # seconds the server waits for a round's replies
      backend: ray           # ray: Flower's simulation engine; inline: in-process Grid (tests, debugging)
      num_cpus: 1            # Ray: CPUs per client (concurrency = cores / num_cpus)
      fail: {}               # fault injection for tests: {client: 1, round: 2, mode: raise|hang|exit}
      secret: random         # random: clients seed their noise / shuffles from a secret the server never
                             # sees; seeded: from the run seed (exact reruns; the server can regenerate them)
      dp: none               # client-level DP (veil/federated/dp.py): none | client-fixed | client-adaptive |
                             # server-fixed | server-adaptive (central: the server adds the noise; where the update
                             # is clipped) | local (each client clips and noises its own update)
      dp_noise: 1.0          # noise multiplier z: central, N(0, (z C / k)^2) on the mean of k clipped updates;
                             # local, N(0, (2 z C)^2) on each clipped update
      dp_clip: 1.0           # clipping norm C of a client's update (adaptive: the initial one)
      dp_delta: 0.0          # delta of the reported epsilon (0: 1 / clients)
      dp_quantile: 0.5       # adaptive: target fraction of updates under the clip
      dp_clip_lr: 0.2        # adaptive: the clip's geometric learning rate
      dp_count_std: 0.0      # adaptive: noise std of the unclipped count (0: Flower's default k / 20)

Every bad key or value is a one-line `VeilError`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from veil.errors import VeilError
from veil.federated.client_secret import MODES as SECRET_MODES


@dataclass
class FederatedConfig:
    clients: int = 10
    rounds: int = 30
    partition: str = "dirichlet"
    alpha: float = 0.5
    mode: str = "fedavg"
    local_epochs: int = 1
    local_steps: int = 0
    strategy: str = "fedavg"
    proximal_mu: float = 0.0
    fraction: float = 1.0
    audit: list[Any] = field(default_factory=list)
    audit_every: int = 1
    audit_clients: int = 1
    timeout: float = 600.0
    backend: str = "ray"
    num_cpus: float = 1.0
    fail: dict[str, Any] = field(default_factory=dict)
    secret: str = "random"
    dp: str = "none"
    dp_noise: float = 1.0
    dp_clip: float = 1.0
    dp_delta: float = 0.0
    dp_quantile: float = 0.5
    dp_clip_lr: float = 0.2
    dp_count_std: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """The resolved section; without DP its dp_* keys are left out, so the spec text (which a
        run folder's config.yaml and every message carry) is what it was before DP existed."""
        d = dataclasses.asdict(self)
        if self.dp == "none":
            d = {k: v for k, v in d.items() if not k.startswith("dp")}
        return d


_CHOICES = {
    "partition": ("iid", "dirichlet"),
    "mode": ("fedavg", "fedsgd"),
    "strategy": ("fedavg", "fedprox"),
    "backend": ("ray", "inline"),
    "secret": SECRET_MODES,
}


def coerce(cls: type, raw: Any, section: str) -> Any:
    """Build dataclass `cls` from a mapping, checking keys and scalar types (ints accepted as floats)."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise VeilError(f"config section '{section}' must be a mapping")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    default = cls()
    values: dict[str, Any] = {}
    for key, val in raw.items():
        if key not in fields:
            raise VeilError(f"unknown config key '{section}.{key}'; allowed: {', '.join(sorted(fields))}")
        want = type(getattr(default, key))
        if want is float and isinstance(val, int) and not isinstance(val, bool):
            val = float(val)
        if want is list and isinstance(val, (str, dict)):
            val = [val]
        if not isinstance(val, want) or (want is int and isinstance(val, bool)):
            raise VeilError(f"config key '{section}.{key}' must be {want.__name__}, got {val!r}")
        values[key] = val
    return cls(**values)


def check_choices(cfg: Any, section: str, choices: dict[str, tuple[str, ...]]) -> None:
    """Every `choices` key of `cfg` holds one of its allowed values."""
    for key, allowed in choices.items():
        if getattr(cfg, key) not in allowed:
            raise VeilError(f"{section}.{key} must be one of {', '.join(allowed)}, got {getattr(cfg, key)!r}")


def federated_config(raw: Any) -> FederatedConfig:
    fed = coerce(FederatedConfig, raw, "federated")
    check_choices(fed, "federated", _CHOICES)
    if fed.clients < 1 or fed.rounds < 1:
        raise VeilError(
            f"federated.clients and federated.rounds must be at least 1, got {fed.clients} and {fed.rounds}"
        )
    if not 0.0 < fed.fraction <= 1.0:
        raise VeilError(f"federated.fraction must be in (0, 1], got {fed.fraction}")
    if fed.alpha <= 0:
        raise VeilError(f"federated.alpha must be positive, got {fed.alpha}")
    if fed.audit_every < 1 or fed.audit_clients < 0:
        raise VeilError("federated.audit_every must be >= 1 and federated.audit_clients >= 0")
    from veil.federated.dp import check_dp

    check_dp(fed)
    fed.audit = [a if isinstance(a, dict) else {"name": a} for a in fed.audit]
    if any(not isinstance(a.get("name"), str) for a in fed.audit):
        raise VeilError("each federated.audit entry must be an attack name or a mapping with a 'name' key")
    return fed


EXTRA_SECTIONS = ("federated", "split")


def split_sections(raw: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the model/data/defense/train mapping `veil.config.from_dict` reads, the extra sections)."""
    base = {k: v for k, v in raw.items() if k not in EXTRA_SECTIONS}
    extra = {k: raw[k] for k in EXTRA_SECTIONS if k in raw}
    return base, extra


def apply_extra_overrides(extra: dict[str, Any], overrides: list[str]) -> tuple[dict[str, Any], list[str]]:
    """Take `federated.x=v` / `split.x=v` overrides out of the list; the rest go to `veil.config`."""
    from veil.config import parse_value

    extra = {k: dict(v or {}) for k, v in extra.items()}
    rest = []
    for item in overrides:
        key = item.split("=", 1)[0].strip()
        section, _, sub = key.partition(".")
        if section in EXTRA_SECTIONS and sub and "=" in item:
            extra.setdefault(section, {})[sub] = parse_value(item.split("=", 1)[1])
        else:
            rest.append(item)
    return extra, rest


@dataclass
class SplitConfig:
    """The `split:` section (veil split):

    protocol: pfesta        # sl | festa | pfesta | fl | central
    tasks: [classify, zones, segment]
    clients_per_task: 2
    epochs: 20              # passes over each client's shard
    unify_every: 0          # global steps between FedAvg of heads/tails within a task (0: once per epoch)
    task_scale: {}          # per-task gradient scaling at the body, e.g. {classify: 1, zones: 2, segment: 10}
    permute: true           # pfesta: the permutation module (false: same protocol, patches in order)
    backend: inline         # inline | ray
    eval_every: 0           # epochs between evaluations (0: only at the end)
    freeze_head: false      # central only: keep the patch-embedding head at its initialisation, as p-FeSTA does
    secret: random          # random: permutation keys also seeded from a client-held secret; seeded: from the run seed
    """

    protocol: str = "pfesta"
    tasks: list[Any] = field(default_factory=lambda: ["classify", "zones", "segment"])
    clients_per_task: int = 2
    epochs: int = 20
    unify_every: int = 0
    task_scale: dict[str, Any] = field(default_factory=dict)
    permute: bool = True
    backend: str = "inline"
    eval_every: int = 0
    num_cpus: float = 1.0
    freeze_head: bool = False
    secret: str = "random"


_SPLIT_CHOICES = {
    "protocol": ("sl", "festa", "pfesta", "fl", "central"),
    "backend": ("inline", "ray"),
    "secret": SECRET_MODES,
}


def split_config(raw: Any) -> SplitConfig:
    from veil.federated.multitask import TASKS

    sc = coerce(SplitConfig, raw, "split")
    check_choices(sc, "split", _SPLIT_CHOICES)
    bad = [t for t in sc.tasks if t not in TASKS]
    if bad or not sc.tasks:
        raise VeilError(f"split.tasks must be a non-empty list from {', '.join(TASKS)}, got {sc.tasks!r}")
    if sc.clients_per_task < 1 or sc.epochs < 1:
        raise VeilError("split.clients_per_task and split.epochs must be at least 1")
    return sc
