"""The `federated:` section of a run config (read beside model/data/defense/train): FedAvg / FedProx.

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
      dp: none               # client-level DP (veil/federated/fedavg/dp.py): none | client-fixed | client-adaptive |
                             # server-fixed | server-adaptive (central: the server adds the noise; where the update
                             # is clipped) | local (each client clips and noises its own update)
      dp_noise: 1.0          # noise multiplier z: central, N(0, (z C / k)^2) on the mean of k clipped updates;
                             # local, N(0, (2 z C)^2) on each clipped update
      dp_clip: 1.0           # clipping norm C of a client's update (adaptive: the initial one)
      dp_delta: 0.0          # delta of the reported epsilon (0: 1 / clients)
      dp_quantile: 0.5       # adaptive: target fraction of updates under the clip
      dp_clip_lr: 0.2        # adaptive: the clip's geometric learning rate
      dp_count_std: 0.0      # adaptive: noise std of the unclipped count (0: Flower's default k / 20)
      secagg: null           # Flower's SecAgg+ (veil/federated/fedavg/secagg.py): true or {num_shares: 3,
                             # reconstruction_threshold: 2, clipping_range: 8.0, quantization_range: 2**22,
                             # modulus_range: 2**32, max_weight: 1000.0}; the server then sees only the sum

Every bad key or value is a one-line `VeilError`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from veil.config import coerce_section
from veil.errors import VeilError
from veil.federated.client_secret import MODES as SECRET_MODES
from veil.federated.fedavg.dp import check_dp
from veil.federated.fedavg.secagg import check_secagg
from veil.federated.sections import check_choices


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
    secagg: Any = None

    def to_dict(self) -> dict[str, Any]:
        """The resolved section; without DP its dp_* keys are left out, so the spec text (which a
        run folder's config.yaml and every message carry) is what it was before DP existed."""
        d = dataclasses.asdict(self)
        if self.dp == "none":
            d = {k: v for k, v in d.items() if not k.startswith("dp")}
        if self.secagg is None:
            d.pop("secagg")
        return d


_CHOICES = {
    "partition": ("iid", "dirichlet"),
    "mode": ("fedavg", "fedsgd"),
    "strategy": ("fedavg", "fedprox"),
    "backend": ("ray", "inline"),
    "secret": SECRET_MODES,
}


def federated_config(raw: Any) -> FederatedConfig:
    secagg = raw.get("secagg") if isinstance(raw, dict) else None  # a mapping or true: `check_secagg`
    if isinstance(raw, dict):
        raw = {k: v for k, v in raw.items() if k != "secagg"}
    fed = coerce_section(FederatedConfig, raw, "federated")
    fed.secagg = secagg
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

    check_dp(fed)
    check_secagg(fed)
    fed.audit = [a if isinstance(a, dict) else {"name": a} for a in fed.audit]
    if any(not isinstance(a.get("name"), str) for a in fed.audit):
        raise VeilError("each federated.audit entry must be an attack name or a mapping with a 'name' key")
    return fed
