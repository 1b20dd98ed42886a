"""One-run audit of client-level DP with canary clients (Steinke, Nasr, Jagielski, NeurIPS 2023,
"Privacy Auditing with One (1) Training Run", Sec. 6, applied to DP-FedAvg: the privacy unit is
the client).

The mechanism under test is the one `veil federate` builds (`veil.federated.fedavg.dp`):
Flower's DP strategy wrapper (``server-fixed`` / ``client-fixed``: clip each client's update
Delta_k to C, average the k sampled ones uniformly, add N(0, (z C / k)^2); veil's all-or-nothing
release) around Flower's FedAvg weighted by ``dp-weight``, and veil's accountant for the claimed
epsilon (Opacus RDP, q = k / N per round). The audit drives that strategy object through R rounds
with crafted replies instead of trained clients:

- m canary clients, each in the federation independently with probability 1/2; canary i replies
  with the update ``C e_i`` (a Dirac update on a coordinate of its own, the largest a clipped
  client may send);
- the other clients reply with random updates of norm 2 C on coordinates no canary uses (clipped
  to C by the mechanism: they change nothing a canary's score reads, but fill the k slots);
- every round samples k of the N = clients + included canaries uniformly without replacement (as
  veil's `AuditedStrategy.sample` does); the score of canary i is the sum over rounds of the
  released global model's change on coordinate i (what anyone who sees the released models reads).

With client-side clipping the clip runs in the client's mod, so the crafted canary replies already
obey it; the server-side variant clips them itself. Epsilon-hat above the accountant's epsilon is
a bug in the mechanism (`veil.metrics.dp_audit.flagged`).
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.serverapp.strategy import FedAvg
from flwr.supercore.task_identity import TaskIdentity

from veil.errors import VeilError
from veil.federated.fedavg import dp
from veil.federated.fedavg.config import FederatedConfig
from veil.metrics.dp_audit import audit, flagged, max_epsilon

KINDS = ("server-fixed", "client-fixed")
NODE0 = 1001  #: node id of the federation's first member (as `veil.federated.grid.LocalGrid` numbers them)


class _Nodes:
    """The Grid surface Flower's FedAvg reads when it samples: this round's node ids."""

    def __init__(self, nodes: list[int]) -> None:
        self.nodes = nodes

    def get_node_ids(self) -> list[int]:
        return list(self.nodes)


def _record(w: np.ndarray) -> ArrayRecord:
    return ArrayRecord({"w": Array(np.ascontiguousarray(w, dtype=np.float64))})


def canary_clients(
    kind: str = "server-fixed",
    clients: int = 100,
    fraction: float = 0.1,
    rounds: int = 50,
    noise: float = 1.0,
    clip: float = 1.0,
    canaries: int = 1000,
    delta: float = 1e-5,
    confidence: float = 0.95,
    seed: int = 0,
    width: int = 8,
    target_epsilon: float | None = None,
) -> dict[str, Any]:
    """Epsilon-hat of Flower's client-level DP (as `veil federate` wraps it) from one run of R
    rounds with `canaries` canary clients, beside the accountant's epsilon; with `target_epsilon`
    the noise multiplier is the one Opacus' accountant picks for it (q = k / N, R rounds, delta)."""
    if kind not in KINDS:
        raise VeilError(f"canary-client audit supports federated.dp {', '.join(KINDS)}, got {kind!r}")
    rng = np.random.default_rng(seed)
    included = rng.random(canaries) < 0.5
    members = [("canary", i) for i in np.nonzero(included)[0]] + [("client", j) for j in range(clients)]
    n = len(members)
    fed = FederatedConfig(
        clients=n, fraction=fraction, dp=kind, dp_noise=noise, dp_clip=clip, dp_delta=delta, secret="random"
    )
    k = dp.sampled_clients(n, fraction)
    if target_epsilon is not None:
        from opacus.accountants.utils import get_noise_multiplier

        fed.dp_noise = noise = float(
            get_noise_multiplier(
                target_epsilon=target_epsilon, target_delta=delta, sample_rate=k / n, steps=rounds, accountant="rdp"
            )
        )
    dp.check_dp(fed)
    inner = FedAvg(
        fraction_train=1.0, min_train_nodes=1, min_available_nodes=1, weighted_by_key=dp.WEIGHT_KEY
    )  # as `server_app.make_strategy` builds it
    strategy = dp.wrap_strategy(inner, fed)
    if getattr(TaskIdentity, "_run_id", None) is None:  # the server process' identity, as LocalGrid sets it
        TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, SUPERLINK_NODE_ID
    w = np.zeros(canaries + width)
    scores = np.zeros(canaries)
    pick = random.Random(seed * 7919 + 1)
    for rnd in range(1, rounds + 1):
        sampled = [NODE0 + i for i in sorted(pick.sample(range(n), k))]
        msgs = list(strategy.configure_train(rnd, _record(w), ConfigRecord({"lr": 0.1}), _Nodes(sampled)))  # type: ignore[arg-type]
        replies = []
        for msg in msgs:
            who, i = members[int(msg.metadata.dst_node_id) - NODE0]
            update = np.zeros_like(w)
            if who == "canary":
                update[i] = clip
            else:
                v = rng.normal(size=width)
                update[canaries:] = 2 * clip * v / np.linalg.norm(v)
            content = RecordDict(
                {"arrays": _record(w + update), "metrics": MetricRecord({"num-examples": 1, dp.WEIGHT_KEY: 1})}
            )
            replies.append(Message(content, reply_to=msg))
        dp.seed_noise(fed, seed, rnd)
        arrays, _ = strategy.aggregate_train(rnd, replies)
        if arrays is None:
            continue
        new = np.asarray(arrays["w"].numpy(), dtype=np.float64)
        scores += (new - w)[:canaries]
        w = new
    claimed = dp.epsilon(fed, rounds)
    out = audit(scores, included, delta, confidence, seed)
    return {
        **out,
        "kind": kind,
        "claimed_epsilon": claimed if claimed is not None else "inf",
        "noise_multiplier": noise,
        "clip": clip,
        "clients": n,
        "sampled": k,
        "rounds": rounds,
        "sample_rate": dp.sample_rate(fed),
        "ceiling": max_epsilon(canaries, delta, confidence),
        "flagged": flagged(out["eps_hat"], claimed),
    }
