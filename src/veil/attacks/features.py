"""Feature-space attacks on split learning: what a curious server rebuilds from the smashed data
(the client's head features) it receives.

1. Decoder-based feature inversion (model inversion on intermediate features; He et al., ACSAC
   2019, "Model inversion attacks against collaborative inference", the learning-based variant):
   the server queries the head H on its own auxiliary images x_a and fits a decoder G by
       min_G  E_a || G(H(x_a)) - x_a ||^2,
   then applies G to the intercepted features f = H(x): x^ = G(f).
2. Feature-space hijacking (Pasquini et al., CCS 2021, "Unleashing the Tiger: Inference Attacks on
   Split Learning", FSHA), passive form: without H, the server trains an encoder F^, a decoder G
   and a discriminator D on its auxiliary data and the stream of intercepted features:
       D:      min  softplus(-D(f)) + softplus(D(F^(x_a)))          (f real, F^(x_a) fake)
       F^, G:  min  || G(F^(x_a)) - x_a ||^2 + lambda softplus(-D(F^(x_a)))
   so F^ maps into the same feature space as H and G inverts it; x^ = G(f). (The active FSHA
   also steers the client's head through the returned gradients; p-FeSTA's head is frozen and
   takes no gradient, so only the passive form applies.)

The decoder reads the N tokens in the order they arrive (a flattened-sequence MLP): it relies on
slot i holding patch i, which is what p-FeSTA's permutation module takes away.

3. Adaptive un-shuffling (`feature_inversion`, on by default wherever the permutation is on; our
   addition, not in the paper): a patch-embedding head is affine per slot, H(x)_i = W p_i + b + e_i. With query access
   the attacker reads E = H(0) (rows b + e_i) and W (H of unit patches minus E). A received token
   t = W p + b + e_j lies in the P-dimensional affine subspace E_j + span(W) only for its true slot
   j (when P < D and the e_i differ), so the residual ||(I - W W^+)(t - E_i)|| is ~0 exactly at
   i = j; a per-sample assignment (Hungarian) on these residuals restores the order before decoding.
   ``unshuffle``: "auto" (default) un-shuffles whenever the attacker knows the permutation module is
   on (``Knowledge.defense["permutation"]["enabled"]``: the server runs the p-FeSTA protocol, so it
   knows); True / False force it (False is the naive decoder of 1.). What it rebuilds with and
   without the permutation, beside the naive decoder: docs/results.md, section federated.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from veil.attacks import ATTACKS
from veil.attacks.base import Attack, Knowledge, Observation, Reconstruction
from veil.attacks.options import Options, option
from veil.errors import VeilError


class Decoder(nn.Module):
    """(B, N, D) tokens -> (B, C, H, W) image in [0, 1]."""

    def __init__(self, tokens: int, dim: int, shape: tuple[int, int, int], hidden: int = 512) -> None:
        super().__init__()
        self.shape = shape
        out = shape[0] * shape[1] * shape[2]
        self.net = nn.Sequential(
            nn.Flatten(),
            nn.Linear(tokens * dim, hidden),
            nn.GELU(),
            nn.Linear(hidden, hidden),
            nn.GELU(),
            nn.Linear(hidden, out),
        )

    def forward(self, f: Tensor) -> Tensor:
        return self.net(f).sigmoid().view(-1, *self.shape)


def _aux(know: Knowledge) -> Tensor:
    aux = know.aux_data
    px = aux.get("pixels") if isinstance(aux, dict) else aux
    if not isinstance(px, Tensor) or px.dim() != 4:
        raise VeilError("feature attacks need Knowledge.aux_data = {'pixels': (M, C, H, W) auxiliary images}")
    return px


@dataclass(frozen=True)
class DecoderOptions(Options):
    """The options of training a `Decoder` on auxiliary images, which both feature attacks do."""

    steps: int = option(1500, "Adam steps training the decoder")
    lr: float = option(1e-3, "Adam learning rate")
    batch: int = option(64, "auxiliary images per step")
    hidden: int = option(512, "decoder width")


@dataclass(frozen=True)
class FeatureInversionOptions(DecoderOptions):
    unshuffle: bool | Literal["auto"] = option(
        "auto", "undo the permutation with the head's affine structure; auto: when the defense says it is on"
    )


@dataclass(frozen=True)
class FSHAOptions(DecoderOptions):  # steps, lr, batch, hidden in that order; FSHA trains three nets
    steps: int = option(2000, "Adam steps of the encoder, decoder and discriminator")
    batch: int = option(64, "auxiliary images (and intercepted features) per step")
    adv: float = option(0.05, "weight of the adversarial term in the encoder-decoder loss")


_DecoderOptionsT = TypeVar("_DecoderOptionsT", bound=DecoderOptions)


class _FeatureAttack(Attack[_DecoderOptionsT]):
    """Feature attacks observe features, not a model: an Observation may carry `model=None`."""

    modality = "image"
    observes = frozenset({"features"})
    protocol_why = "it inverts the head features a split-learning server receives"

    def applies_to(self, model: Any) -> str | None:
        return None if model is None else super().applies_to(model)

    def budget(self) -> dict[str, int]:
        """Training steps of the attacker's networks (the work is the same for any input)."""
        return {"steps": int(getattr(self.options, "steps", 0))}

    def spent(self) -> dict[str, Any]:
        """The account of a run that trained for all its steps."""
        return {"work": {"steps": int(getattr(self.options, "steps", 0))}, "budget_stopped": True}


def _batches(n: int, bs: int, g: torch.Generator) -> Tensor:
    return torch.randint(0, n, (bs,), generator=g)


class FeatureInversion(_FeatureAttack[FeatureInversionOptions]):
    """Decoder trained on (H(x_aux), x_aux); needs query access to the head: `aux_data["head"]`."""

    knows = "the intercepted features, query access to the frozen head and public auxiliary images (unshuffle: the head's affine structure undoes the permutation)"

    def __init__(self, **settings: object) -> None:
        super().__init__(**settings)
        if self.options.unshuffle is False:  # the decoder of 1. alone: blind to the permutation
            self.knows = (
                "the intercepted features, query access to the frozen head and public auxiliary images; "
                "not the permutation (naive)"
            )

    def unshuffles(self, know: Knowledge) -> bool:
        """Whether this run un-shuffles: forced by ``unshuffle``, else when the permutation is known to be on."""
        mode = self.options.unshuffle
        if mode == "auto":
            return bool((know.defense or {}).get("permutation", {}).get("enabled", False))
        return mode

    def _reconstruct(self, obs: Observation, know: Knowledge) -> Reconstruction:
        if obs.features is None:
            raise VeilError("feature_inversion needs intercepted features (Observation.features)")
        head: Callable[[Tensor], Tensor] | None = know.aux_data.get("head") if isinstance(know.aux_data, dict) else None
        if head is None:
            raise VeilError("feature_inversion needs query access to the head: Knowledge.aux_data['head']")
        aux = _aux(know)
        with torch.no_grad():
            feats = head(aux)
        f = obs.features.detach()
        if self.unshuffles(know):
            f = unshuffle(f, head, tuple(aux.shape[1:]))
        with torch.random.fork_rng():  # the decoder's initialisation is seeded too: one seed, one result
            torch.manual_seed(know.seed)
            dec = Decoder(f.shape[1], f.shape[2], tuple(aux.shape[1:]), self.options.hidden)
        opt = torch.optim.Adam(dec.parameters(), lr=self.options.lr)
        g = torch.Generator().manual_seed(know.seed)
        for _ in range(self.options.steps):
            i = _batches(len(aux), self.options.batch, g)
            loss = F.mse_loss(dec(feats[i]), aux[i])
            opt.zero_grad()
            loss.backward()
            opt.step()
        with torch.no_grad():
            return Reconstruction(images=dec(f), stats={"train_mse": float(loss), **self.spent()})


@torch.no_grad()
def unshuffle(f: Tensor, head: Callable[[Tensor], Tensor], shape: tuple[int, int, int]) -> Tensor:
    """Put each sample's tokens back in slot order using the head's affine structure (see 3.)."""
    from scipy.optimize import linear_sum_assignment

    E = head(torch.zeros(1, *shape))[0].double()  # (N, D): b + e_i
    N = E.shape[0]
    P = shape[0] * shape[1] * shape[2] // N
    p = int(round((P // shape[0]) ** 0.5))
    from veil.models.vit import unpatchify

    patches = torch.zeros(P, N, P)
    patches[torch.arange(P), 0, torch.arange(P)] = 1.0  # unit patch k in slot 0
    basis = unpatchify(patches, p, shape[0], shape[1])
    W = (head(basis)[:, 0].double() - E[0]).t()  # (D, P)
    proj = torch.eye(W.shape[0], dtype=torch.float64) - W @ torch.linalg.pinv(W)
    r = f.double()[:, :, None, :] - E[None, None]  # (B, N_tokens, N_slots, D)
    cost = (r @ proj).norm(dim=-1)  # residual off the slot's subspace
    out = torch.empty_like(f)
    for b in range(f.shape[0]):  # one small assignment per sample
        tok, slot = linear_sum_assignment(cost[b].numpy())
        out[b, torch.as_tensor(slot)] = f[b, torch.as_tensor(tok)]
    return out


class FeatureHijack(_FeatureAttack[FSHAOptions]):
    """Passive feature-space hijacking: encoder F^ + decoder G + discriminator D (FSHA)."""

    knows = "the intercepted features and public auxiliary images (no access to the head)"

    def _reconstruct(self, obs: Observation, know: Knowledge) -> Reconstruction:
        if obs.features is None:
            raise VeilError("fsha needs intercepted features (Observation.features)")
        aux, f = _aux(know), obs.features.detach()
        N, D = f.shape[1], f.shape[2]
        P = aux.shape[1] * aux.shape[2] * aux.shape[3] // N
        patch = int(round((P // aux.shape[1]) ** 0.5))
        from veil.models.vit import patchify

        enc_proj, enc_pos = nn.Linear(P, D), nn.Parameter(torch.randn(N, D) * 0.02)  # F^: same form as a patch embedder
        enc = lambda x: enc_proj(patchify(x, patch)) + enc_pos  # noqa: E731
        dec = Decoder(N, D, tuple(aux.shape[1:]), self.options.hidden)
        disc = nn.Sequential(nn.Flatten(), nn.Linear(N * D, 256), nn.LeakyReLU(0.2), nn.Linear(256, 1))
        opt_g = torch.optim.Adam([*enc_proj.parameters(), enc_pos, *dec.parameters()], lr=self.options.lr)
        opt_d = torch.optim.Adam(disc.parameters(), lr=self.options.lr)
        g = torch.Generator().manual_seed(know.seed)
        for _ in range(self.options.steps):
            xa = aux[_batches(len(aux), self.options.batch, g)]
            real = f[_batches(len(f), self.options.batch, g)]
            fake = enc(xa)
            d_loss = F.softplus(-disc(real)).mean() + F.softplus(disc(fake.detach())).mean()
            opt_d.zero_grad()
            d_loss.backward()
            opt_d.step()
            g_loss = F.mse_loss(dec(fake), xa) + self.options.adv * F.softplus(-disc(fake)).mean()
            opt_g.zero_grad()
            g_loss.backward()
            opt_g.step()
        with torch.no_grad():
            return Reconstruction(
                images=dec(f), stats={"d_loss": float(d_loss), "g_loss": float(g_loss), **self.spent()}
            )


ATTACKS.register(
    "feature_inversion",
    "split learning: decoder trained on the head's features of auxiliary data, applied to intercepted features",
)(FeatureInversion)
ATTACKS.register(
    "fsha", "split learning: feature-space hijacking (encoder + decoder + discriminator on auxiliary data), passive"
)(FeatureHijack)

#: the split audit's rows, label -> options (`row_entry`): the inversion that un-shuffles through
#: the head first (the verdict wherever the permutation is on), then the naive decoder the
#: p-FeSTA claim rests on, then FSHA
SPLIT_ROWS: dict[str, dict[str, Any]] = {"feature_inversion+unshuffle": {}, "feature_inversion": {}, "fsha": {}}


def row_entry(row: str, settings: dict[str, Any] | None = None) -> dict[str, Any]:
    """The attack entry (`{name, <options>}`) of a split-audit row: the attack is the name before
    '+'; the bare ``feature_inversion`` row is the naive decoder (``unshuffle: false``)."""
    settings = dict(settings or {})
    if row == "feature_inversion":
        settings = {"unshuffle": False, **settings}
    return {"name": row.split("+")[0], **settings}
