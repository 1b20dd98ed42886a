"""Multi-round attackers of a passive FedAvg / FedSGD server: attacks on what several rounds reveal
together, not on one update.

  multi-round         the client's pseudo-gradients averaged over the R rounds the server received
                   them (Observation built by `veil.federated.fedavg.auditor`):
                       ḡ_R = (1/R) sum_r (w_r - w_{k,r}) / (τ_r s_r)
                   A defense that adds fresh zero-mean noise every round (DP-SGD's Gaussian noise,
                   AEGIS's calibrated noise, `gaussian`) leaves ḡ_R with noise variance σ²/R, while
                   the client's data term stays (it changes only as w_r drifts). This is the
                   averaging attack on repeated noisy releases (e.g. the composition argument of
                   Abadi et al., CCS 2016; Geiping et al. 2020 sec. 5 note that FedAvg repeats the
                   same samples every round). The inner attack (`attack`, default ig) then runs on
                   ḡ_R at the current global weights.
  multi-round-global  the difference of consecutive global models, (w_{r-1} - w_r) / (τ_{r-1} s̄): the
                   aggregate of round r-1, which every client (and anyone who sees the broadcast)
                   receives; one rebuild, scored against each audited client's samples of
                   round r-1 (the same reference, so the same chance level, as per-client attacks).

The wrapper itself adds no optimisation: it names the view and delegates to the inner attack
(ig, dlg or labels: the attacks that read a pseudo-gradient; ig-fedavg simulates one client's
round and APRIL one gradient, neither models a mean over rounds or clients).

Scope: passive (honest-but-curious). A malicious server (crafted global weights, e.g. trap
weights or "Robbing the Fed") is out of scope: it would change what the clients compute.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from veil.attacks import ATTACKS, create_attack, options_type
from veil.attacks.base import Attack, Knowledge, Observation, Reconstruction
from veil.attacks.options import Options, check, option, specs, split_inner
from veil.errors import VeilError
from veil.models.base import VeilModel


@dataclass(frozen=True)
class MultiRoundOptions(Options):
    inner: ClassVar[str | None] = "attack"  # every other key is an option of that attack

    attack: Literal["ig", "dlg", "labels"] = option(
        "ig", "the inner attack (one that reads a pseudo-gradient); its options go beside this key"
    )


class MultiRound(Attack[MultiRoundOptions]):
    """`{name: multi-round, attack: ig, <the inner attack's options>}`: the inner attack on the
    client's mean update over the rounds so far."""

    modality = "any"
    observes = frozenset({"rounds"})  # the auditor supplies the combined view (`veil.federated.fedavg.auditor`)
    protocol_why = "it combines what a FedAvg server sees of a client over rounds"

    def __init__(self, **settings: object) -> None:
        own, rest = split_inner(MultiRoundOptions, settings)
        super().__init__(**own)
        self.settings = dict(settings)
        inner = self.options.attack
        # an unknown key is named among both sets of options, this attack's and its inner attack's
        check(self.name, {**specs(MultiRoundOptions), **specs(options_type(inner))}, settings)
        self.inner = create_attack(inner, **rest)
        self.knows = (
            f"every round's update of the client, averaged ({inner} on the mean: fresh per-round noise averages out); "
            "not the defense (naive)"
            if "rounds" in self.observes
            else f"the consecutive global models only ({inner} on their difference, the round's aggregate); not the defense (naive)"
        )

    def applies_to(self, model: VeilModel) -> str | None:
        return self.inner.applies_to(model)

    def budget(self) -> dict[str, int] | None:
        """The inner attack's budget: the wrapper adds no work of its own."""
        return self.inner.budget()

    def _reconstruct(self, obs: Observation, know: Knowledge) -> Reconstruction:
        if obs.kind not in ("delta", "gradient"):
            raise VeilError(
                "multi-round reads model updates (the auditor's combined view), not split-learning features"
            )
        return self.inner.reconstruct(obs, know)


class GlobalDifference(MultiRound):
    """`{name: multi-round-global, attack: ig, ...}`: the inner attack on the difference of
    consecutive global models (the previous round's aggregate)."""

    observes = frozenset({"aggregate"})


ATTACKS.register(
    "multi-round",
    "multi-round attacker: ig / dlg / labels on a client's updates averaged over the rounds "
    "so far (averages away fresh per-round noise)",
)(MultiRound)
ATTACKS.register(
    "multi-round-global",
    "multi-round attacker: ig / dlg / labels on the difference of consecutive global "
    "models (the previous round's aggregate)",
)(GlobalDifference)

__all__ = ["GlobalDifference", "MultiRound"]
