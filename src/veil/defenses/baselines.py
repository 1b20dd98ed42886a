"""Gradient-perturbation baselines AEGIS is compared with.

- ``prune`` — gradient pruning (Zhu et al., NeurIPS 2019, "Deep Leakage from Gradients", Sec. 5):
  per parameter tensor, zero the ``ratio`` share of entries with the smallest magnitude and keep
  exactly the k = numel - round(ratio * numel) largest:  g <- g * 1[|g| in top-k(|g|)].
- ``gaussian`` — plain additive noise on every exported gradient (DLG Sec. 5):
  g <- g + N(0, sigma^2 I), sigma absolute, seeded and fresh each call.
- ``dpsgd`` — DP-SGD (Abadi et al., CCS 2016, Alg. 1), in `veil.defenses.dpsgd`.
"""

from __future__ import annotations

from typing import Any

import torch

from veil.defenses import DEFENSES
from veil.defenses.aegis import check_scale
from veil.defenses.base import Defense, KeyedNoiseDefense, check_seed, check_unit_interval
from veil.defenses.noise import keyed_generator
from veil.models.base import VeilModel


def trainable_grads(model: VeilModel) -> list[torch.Tensor]:
    return [p.grad for p in model.parameters() if p.requires_grad and p.grad is not None]


def add_noise_(grad: torch.Tensor, std: float, g: torch.Generator) -> None:
    """grad += std * N(0, 1) i.i.d. from generator g."""
    if std > 0:
        grad.add_(torch.randn(grad.shape, generator=g, device=grad.device, dtype=grad.dtype), alpha=std)


def prune_topk_(grad: torch.Tensor, ratio: float) -> None:
    """Zero all but the k = numel - round(ratio * numel) largest-magnitude entries, in place."""
    n = grad.numel()
    k = n - int(round(ratio * n))
    if k >= n:
        return
    flat = grad.view(-1)
    if k <= 0:
        flat.zero_()
        return
    keep = torch.zeros(n, dtype=torch.bool, device=grad.device)
    keep[flat.abs().topk(k, sorted=False).indices] = True
    flat.masked_fill_(~keep, 0)


class Prune(Defense):
    """Top-k magnitude gradient pruning, per parameter tensor."""

    def __init__(self, ratio: float = 0.9) -> None:
        super().__init__()
        self.ratio = check_unit_interval("ratio", ratio)

    def transform_grads(self, model: VeilModel, step: int) -> None:
        if self.ratio == 0:
            return
        for g in trainable_grads(model):
            prune_topk_(g, self.ratio)

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "ratio": self.ratio}


class GaussianNoise(KeyedNoiseDefense):
    """N(0, sigma^2) on every gradient entry, seeded, fresh each call."""

    def __init__(self, sigma: float = 0.01, seed: int = 0) -> None:
        super().__init__()
        self.sigma = check_scale("sigma", sigma)
        self.seed = check_seed(seed)

    def _attach(self, model: VeilModel) -> None:
        self._calls = 0

    def transform_grads(self, model: VeilModel, step: int) -> None:
        if self.sigma == 0:
            return
        grads = trainable_grads(model)
        if not grads:
            return
        g = keyed_generator(self.seed, step, self._calls, grads[0].device, self.secret)
        self._calls += 1
        for grad in grads:
            add_noise_(grad, self.sigma, g)

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "sigma": self.sigma, "law": "N(0, sigma^2) on every gradient entry"}


DEFENSES.register("prune", "top-k magnitude gradient pruning (DLG): zero the `ratio` smallest entries per tensor")(
    Prune
)
DEFENSES.register("gaussian", "plain Gaussian noise N(0, sigma^2) on every exported gradient")(GaussianNoise)
