"""APRIL-style closed-form attack on a ViT's patch embedding (Lu et al., CVPR 2022, "APRIL:
Finding the Achilles' Heel on Privacy for Vision Transformers").

A ViT embeds the N patches of one image, X in R^{N x P} (P = C p^2, row-major patch grid), as

    Z = X W^T + 1 b^T + E_pos[1:]              Z, E_pos[1:] in R^{N x D},  W in R^{D x P}

and everything after (pre-LN blocks, head) only sees Z. Let G = dL/dZ in R^{N x D}. Because the
position embedding enters additively, row by row,

    dL/dE_pos[1:] = G                           (batch 1; at batch B it is the sum over images)
    dL/dW         = G^T X                       (D x P)
    dL/db         = G^T 1                       (D)

so the patches follow from the two exported gradients by a least-squares solve,

    X = pinv(G^T) dL/dW,

exact whenever G has full row rank, i.e. N <= D (16 <= 64 on `vit-digits`, 64 <= 192 on
`vit-tiny`). The image is `unpatchify(X)`. A Conv2d patch embedding (Hugging Face ViT) is the
same linear map: its weight gradient (D, C, p, p) reshapes to (D, P) in `patchify`'s order.
No norm or residual needs removing: G is whatever the full pre-LN network sends back to Z.

Under MJP (Ren et al.) the masked slots use the shared E_unk instead of their own row, so their
rows of dL/dE_pos are exactly zero and E_unk's gradient is only their sum. This naive solve
ignores that: pinv gives the masked slots zero rows, so the masked patches come out black (clamped
to 0), and every unmasked patch is off too, because the masked slots' share of dL/dW = G^T X is
spread over it, and DAL's term (Eq. 4, added to the unmasked rows of dL/dE_pos) corrupts G. The
low PSNR is this attacker's failure, not MJP's protection: `april-mjp` (`veil.attacks.april_mjp`)
knows the mechanism and recovers the unmasked patches exactly and the masked ones as a set.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from veil.attacks import ATTACKS
from veil.attacks.base import Attack, Knowledge, Observation, Reconstruction, param_names
from veil.attacks.options import Options, option
from veil.errors import VeilError
from veil.models.base import VeilModel
from veil.models.vit import unpatchify


def patch_geometry(model: VeilModel) -> tuple[int, int, int]:
    """(patch size, channels, image size) of a ViT-like model."""
    if hasattr(model, "cfg") and hasattr(model.cfg, "patch_size"):
        c = model.cfg
        return c.patch_size, c.in_chans, c.image_size
    cfg = model.hf.config  # HF ViT adapter
    return cfg.patch_size, cfg.num_channels, cfg.image_size


def weight_as_matrix(grad: Tensor) -> Tensor:
    """Linear (D, P) stays; Conv2d (D, C, p, p) flattens to (D, C*p*p) in patchify order."""
    return grad.reshape(grad.shape[0], -1)


def position_rows(obs: Observation) -> Tensor:
    """dL/dE_pos for the patch slots, (N, D): the rows before the patches ([CLS]; DeiT's
    distillation token too: the model's ``pos_offset``) dropped, HF's (1, N+k, D) squeezed."""
    g = obs.grad(obs.model.position_table())
    g = g.reshape(-1, g.shape[-1])
    return g[getattr(obs.model, "pos_offset", 1) :]


def solve_patches(G: Tensor, dW: Tensor, rcond: float = 1e-7) -> Tensor:
    """X (N, P) from G (N, D) and dW = G^T X (D, P), least squares in float64."""
    Gt = G.double().t()
    X = torch.linalg.pinv(Gt, rtol=rcond) @ dW.double()
    return X.to(dW.dtype)


@dataclass(frozen=True)
class AprilOptions(Options):
    rcond: float = option(1e-7, "relative cut-off of the pseudo-inverse of the position gradient")
    clamp: bool = option(True, "clamp the rebuilt image to [0, 1]")


class April(Attack[AprilOptions]):
    """APRIL closed form from the position- and patch-embedding gradients (batch 1)."""

    knows = "the update of one image (batch 1) and the weights; not the defense (naive)"
    modality = "image"
    closed_form = "one least-squares solve"
    max_batch = (1, "dL/dE_pos sums the images' G rows at a larger batch, so the solve has no single image")
    observes = frozenset({"gradient"})
    protocol_why = "a FedAvg update sums local steps at moving weights, which dL/dW = G^T X does not model"

    def applies_to(self, model: VeilModel) -> str | None:
        reason = super().applies_to(model)
        if reason:
            return reason
        if not hasattr(model, "patches") or not hasattr(model, "grid"):
            return f"april attacks ViTs with a patch embedding; {type(model).__name__} has none"
        return None

    def reads(self, model: VeilModel) -> list[str]:
        """The position table's and the patch embedding's gradients."""
        return param_names(model, [model.position_table(), model.token_embedding()])

    def _reconstruct(self, obs: Observation, know: Knowledge) -> Reconstruction:
        model = obs.model
        p, chans, size = patch_geometry(model)
        G = position_rows(obs)
        dW = weight_as_matrix(obs.grad(model.token_embedding()))
        if G.shape[0] != model.grid**2:
            raise VeilError(
                f"april: position gradient has {G.shape[0]} patch rows, the model has {model.grid**2} patches"
            )
        X = solve_patches(G, dW, self.options.rcond)
        img = unpatchify(X.unsqueeze(0), p, chans, size)
        if self.options.clamp:
            img = img.clamp(0.0, 1.0)
        rank = int(torch.linalg.matrix_rank(G.double()))
        batch = know.batch_size or 1
        return Reconstruction(
            images=img.detach(),
            stats={
                "rank": rank,
                "patches": G.shape[0],
                "width": G.shape[1],
                "exact_possible": rank == G.shape[0] and batch == 1,
            },
        )


ATTACKS.register("april", "APRIL closed form: patches = pinv(dL/dE_pos^T) dL/dW_patch (ViT, batch 1)")(April)
