"""Client-level differential privacy for `veil federate`: Flower's DP strategy wrappers and client
mods (central DP) and its local DP mod, configured from ``federated.dp*``, with the privacy
accounting Flower leaves out.

Mechanism (DP-FedAvg, McMahan et al., ICLR 2018, "Learning Differentially Private Recurrent
Language Models", Alg. 1 with the flat clip): each sampled client's update Delta_k = w_k - w is
clipped, Delta_k * min(1, C / ||Delta_k||_2), the k clipped updates are averaged uniformly, and the
server adds N(0, (z C / k)^2 I) to the average (z = ``dp_noise``, C = ``dp_clip``). Where the clip
happens is the option: ``client-*`` on the client (`flwr.clientapp.mod.fixedclipping_mod` /
`adaptiveclipping_mod` under `DifferentialPrivacyClientSide{Fixed,Adaptive}Clipping`),
``server-*`` on the server (`DifferentialPrivacyServerSide{Fixed,Adaptive}Clipping`). Adaptive
clipping (Andrew et al., NeurIPS 2021, "Differentially Private Learning with Adaptive Clipping",
Alg. 1): C <- C exp(-eta (b - gamma)), b the noisy fraction of updates with norm <= C (noise std
sigma_b, ``dp_count_std``), gamma = ``dp_quantile``, eta = ``dp_clip_lr``; the update noise becomes
z_Delta = (z^-2 - (2 sigma_b)^-2)^(-1/2) so that the pair costs what one Gaussian mechanism with z
costs (their Thm. 1). Flower 1.42 counts *clipped* updates in b (the sign is reversed: C shrinks
when every update is clipped); `_Andrew` counts the unclipped ones, as the paper does. A round
whose k sampled clients did not all reply releases nothing (`_AllOrNothing`; Flower only warns).

Accounting: Opacus's RDP accountant of the sub-sampled Gaussian mechanism, one step per round,
sample rate q = k / N (k = ceil(N * fraction) clients of N), noise multiplier z (adaptive: a
smaller one, `accounted_noise`: Flower's noisy count has sensitivity 1, not the 1/2 its z_Delta
assumes); epsilon at ``dp_delta`` (0: delta = 1 / N). Every round counts, released or not.

Local DP (``local``, `flwr.clientapp.mod.LocalDpMod`): each client clips its own update to C and
adds N(0, (2 z C)^2) before sending it, z the noise multiplier at sensitivity 2C (two clipped
updates differ by at most 2C); the noise is seeded from the client's secret. Against the server
this is a Gaussian mechanism per round with no amplification (the server knows whom it sampled):
RDP at q = 1, every round counted for every client (an upper bound when fraction < 1).

What the central variants protect, and what not (read before quoting an epsilon): client-level
DP of the *global models the server releases*, against the clients and anyone who sees a model.
The server adds the noise, so it sees each update un-noised: clipped by the client (client-*) or
raw (server-*). Against the curious server that veil's auditor plays, central DP gives nothing;
the audit events of a DP run measure exactly that. The RDP bound assumes Poisson sampling; veil
samples k clients without replacement (exact at fraction 1, the usual approximation below).
Aggregation is uniform under DP (each reply carries weight ``dp-weight`` = 1): FedAvg's
num-examples weights would break the C / k sensitivity. The noise comes from numpy's global RNG,
seeded per round from OS entropy (``secret: random``) or from the run seed (``secret: seeded``:
reproducible, but whoever holds the config can subtract the noise — no guarantee then).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, Context, Message, MetricRecord
from flwr.clientapp.mod import LocalDpMod
from flwr.clientapp.typing import ClientAppCallable
from flwr.serverapp.strategy import (
    DifferentialPrivacyClientSideAdaptiveClipping,
    DifferentialPrivacyClientSideFixedClipping,
    DifferentialPrivacyServerSideAdaptiveClipping,
    DifferentialPrivacyServerSideFixedClipping,
    Strategy,
)

from veil.errors import VeilError
from veil.federated.client_secret import derive, round_secret

KINDS = ("none", "client-fixed", "client-adaptive", "server-fixed", "server-adaptive", "local")
WEIGHT_KEY = "dp-weight"  # the unit weight each reply carries under DP: uniform aggregation


def sampled_clients(clients: int, fraction: float) -> int:
    """k, the clients of a round (`AuditedStrategy.sample` draws this many)."""
    return max(1, int(math.ceil(clients * fraction)))


def check_dp(fed: Any) -> None:
    """One-line errors for the ``federated.dp*`` keys (called by `federated_config`)."""
    if fed.dp not in KINDS:
        raise VeilError(f"federated.dp must be one of {', '.join(KINDS)}, got {fed.dp!r}")
    if fed.dp == "none":
        default = type(fed)()
        unused = [
            k
            for k in ("dp_noise", "dp_clip", "dp_delta", "dp_quantile", "dp_clip_lr", "dp_count_std")
            if getattr(fed, k) != getattr(default, k)
        ]
        if unused:
            raise VeilError(
                f"federated.{unused[0]} is set but federated.dp is none; pick one of {', '.join(KINDS[1:])}"
            )
        return
    if fed.mode != "fedavg":
        raise VeilError(f"federated.dp={fed.dp} needs federated.mode=fedavg (it clips weight updates), got {fed.mode}")
    if not (math.isfinite(fed.dp_noise) and fed.dp_noise >= 0):
        raise VeilError(f"federated.dp_noise must be a noise multiplier >= 0, got {fed.dp_noise}")
    if not (math.isfinite(fed.dp_clip) and fed.dp_clip > 0):
        raise VeilError(f"federated.dp_clip must be a clipping norm > 0, got {fed.dp_clip}")
    if not 0.0 <= fed.dp_delta < 1.0:
        raise VeilError(f"federated.dp_delta must be in [0, 1) (0: 1 / clients), got {fed.dp_delta}")
    if not 0.0 <= fed.dp_quantile <= 1.0 or fed.dp_clip_lr <= 0 or fed.dp_count_std < 0:
        raise VeilError(
            "federated.dp_quantile must be in [0, 1], dp_clip_lr > 0 and dp_count_std >= 0, got "
            f"{fed.dp_quantile}, {fed.dp_clip_lr}, {fed.dp_count_std}"
        )
    k = sampled_clients(fed.clients, fed.fraction)
    std = fed.dp_count_std or k / 20
    if fed.dp.endswith("adaptive") and fed.dp_noise > 0 and fed.dp_noise >= 2 * std:
        raise VeilError(
            f"federated.dp_noise {fed.dp_noise} needs dp_count_std > {fed.dp_noise / 2:g} for adaptive clipping "
            f"(z_Delta = (z^-2 - (2 dp_count_std)^-2)^-1/2); dp_count_std is {std:g}"
        )


class _AllOrNothing:
    """Release a round only when all k sampled clients replied: the noise z C / k is calibrated to
    a mean over k updates (Flower only warns); `released` says whether the last round did."""

    released: bool = False

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = list(replies)
        self.released = len(replies) == self.num_sampled_clients  # type: ignore[attr-defined]
        if not self.released:
            return None, None
        return super().aggregate_train(server_round, replies)  # type: ignore[misc]


class _Andrew(_AllOrNothing):
    """Adaptive clipping's update with b = the fraction of *unclipped* updates (Andrew et al.)."""

    def _geometric_update(self, clipped_fraction: float) -> None:
        super()._geometric_update(1.0 - clipped_fraction)  # type: ignore[misc]


class ClientFixed(_AllOrNothing, DifferentialPrivacyClientSideFixedClipping):
    pass


class ServerFixed(_AllOrNothing, DifferentialPrivacyServerSideFixedClipping):
    pass


class ClientAdaptive(_Andrew, DifferentialPrivacyClientSideAdaptiveClipping):
    pass


class ServerAdaptive(_Andrew, DifferentialPrivacyServerSideAdaptiveClipping):
    pass


def wrap_strategy(inner: Strategy, fed: Any) -> Strategy:
    """`inner` (FedAvg / FedProx weighted by `WEIGHT_KEY`) behind the DP wrapper `fed.dp` names."""
    if fed.dp in ("none", "local"):
        return inner
    k = sampled_clients(fed.clients, fed.fraction)
    if fed.dp.endswith("fixed"):
        return (ClientFixed if fed.dp == "client-fixed" else ServerFixed)(inner, fed.dp_noise, fed.dp_clip, k)
    cls = ClientAdaptive if fed.dp == "client-adaptive" else ServerAdaptive
    return cls(
        inner,
        fed.dp_noise,
        k,
        initial_clipping_norm=fed.dp_clip,
        target_clipped_quantile=fed.dp_quantile,
        clip_norm_lr=fed.dp_clip_lr,
        clipped_count_stddev=fed.dp_count_std or None,
    )


def local_mod(fed: Any, seed: int) -> Callable[[Message, Context, ClientAppCallable], Message]:
    """Flower's `LocalDpMod` with sensitivity 2C and noise std 2 z C, its numpy noise seeded from
    this (round, client)'s secret (`veil.federated.client_secret`; the server cannot regenerate it
    unless ``secret: seeded``). LocalDpMod takes (epsilon, delta) of the classical Gaussian
    mechanism, std = sensitivity sqrt(2 ln(1.25 / delta)) / epsilon: they are set to give 2 z C."""
    cal_delta = 1e-5
    eps = math.sqrt(2 * math.log(1.25 / cal_delta)) / fed.dp_noise if fed.dp_noise > 0 else math.inf
    dp_mod = LocalDpMod(fed.dp_clip, 2 * fed.dp_clip, eps, cal_delta)

    def mod(msg: Message, ctx: Context, call_next: ClientAppCallable) -> Message:
        rnd, pid = int(msg.content["config"]["server-round"]), int(ctx.node_config.get("partition-id", 0))
        np.random.seed(np.random.SeedSequence(derive(round_secret(fed.secret, seed, rnd, pid), 1)).generate_state(4))
        return dp_mod(msg, ctx, call_next)

    return mod


def reply_metrics(fed: Any) -> dict[str, int]:
    """What a client adds to its train metrics: the unit aggregation weight under DP."""
    return {WEIGHT_KEY: 1} if fed.dp != "none" else {}


def delta(fed: Any) -> float:
    return fed.dp_delta or 1.0 / fed.clients


def accounted_noise(fed: Any) -> float:
    """The noise multiplier the accountant composes per round.

    Fixed clipping: z. Adaptive: the update noise z_Delta = (z^-2 - (2 s)^-2)^(-1/2) (Flower) and
    the count noise s (``dp_count_std``, default k / 20) compose to a Gaussian mechanism with
    (z_Delta^-2 + s^-2)^(-1/2) = (z^-2 + 3 / (4 s^2))^(-1/2): Flower counts 0/1 indicators, whose
    sum moves by 1 when a client is added, not by the 1/2 of Andrew et al.'s centred indicators
    that its z_Delta assumes; so the pair costs more than z alone."""
    if not fed.dp.endswith("adaptive") or fed.dp_noise == 0:
        return fed.dp_noise  # local: z of the Gaussian mechanism at sensitivity 2C
    s = fed.dp_count_std or sampled_clients(fed.clients, fed.fraction) / 20
    return (fed.dp_noise**-2 + 3 / (4 * s * s)) ** -0.5


def epsilon(fed: Any, rounds: int) -> float | None:
    """Epsilon after `rounds` rounds at `delta(fed)`; None when the noise is 0 (no guarantee)."""
    from opacus.accountants import RDPAccountant  # opacus loads only when an epsilon is asked for

    if fed.dp_noise == 0:
        return None
    acc = RDPAccountant()
    acc.history = [(accounted_noise(fed), sample_rate(fed), rounds)]
    return float(acc.get_epsilon(delta(fed)))


def sample_rate(fed: Any) -> float:
    """q of the accountant: k / N; 1 for local DP (the server knows whom it sampled)."""
    return 1.0 if fed.dp == "local" else sampled_clients(fed.clients, fed.fraction) / fed.clients


def seed_noise(fed: Any, seed: int, rnd: int) -> None:
    """Seed numpy's global RNG, which Flower's DP wrappers draw from, for round `rnd`."""
    if fed.dp in ("none", "local"):
        return
    if fed.secret == "seeded":
        np.random.seed((seed * 1_000_003 + rnd * 10_007 + 977) % 2**32)
    else:
        np.random.seed(np.frombuffer(os.urandom(16), dtype=np.uint32))


def round_fields(fed: Any, strategy: Strategy, rnd: int) -> dict[str, Any]:
    """The DP fields of round `rnd`'s metrics event: epsilon so far and the clip for the next round."""
    if fed.dp == "none":
        return {}
    if fed.dp == "local":
        return {"dp_epsilon": epsilon(fed, rnd), "dp_delta": delta(fed), "dp_clip": fed.dp_clip, "dp_released": True}
    return {
        "dp_epsilon": epsilon(fed, rnd),
        "dp_delta": delta(fed),
        "dp_clip": float(strategy.clipping_norm),
        "dp_released": bool(getattr(strategy, "released", False)),
    }


def restore_clip(fed: Any, strategy: Strategy, metrics: Path) -> None:
    """On resume, adaptive clipping continues from the last completed round's clip."""
    if not fed.dp.endswith("adaptive") or not metrics.is_file():
        return
    clips = [
        e["dp_clip"]
        for e in map(json.loads, metrics.read_text().splitlines())
        if e.get("event") == "round" and "dp_clip" in e
    ]
    if clips:
        strategy.clipping_norm = float(clips[-1])


def summary(fed: Any, rounds: int) -> dict[str, Any]:
    """summary.json's ``dp`` entry."""
    if fed.dp == "none":
        return {"kind": "none"}
    local = fed.dp == "local"
    return {
        "kind": fed.dp,
        "noise_multiplier": fed.dp_noise,
        "accounted_noise_multiplier": accounted_noise(fed),
        "clip": fed.dp_clip,
        "sampled_clients": sampled_clients(fed.clients, fed.fraction),
        "sample_rate": sample_rate(fed),
        "rounds": rounds,
        "delta": delta(fed),
        "epsilon": epsilon(fed, rounds),
        "accountant": "opacus RDP, sub-sampled Gaussian, one step per round"
        + (" (every round counted for every client)" if local else ""),
        "unit": "client (replace one client's data: sensitivity 2C)"
        if local
        else "client (add/remove one client's data)",
        "protects": "each client's updates, against the server and everyone else"
        if local
        else "the released global models, against clients and third parties; not against the server, "
        "which sees every update before its noise",
        "noise_seed": "run seed (reproducible; not private against whoever holds the config)"
        if fed.secret == "seeded"
        else ("each client's secret" if local else "OS entropy per round"),
    }
