"""The observed gradient an optimisation attack matches (DLG, Inverting Gradients) and its distances.

`GradientTarget` holds the observed gradient of the compared parameters and computes dummy
gradients (``create_graph=True``) and their distance to it: L2, the joint cosine (one autograd
node, `_Cosine`: two dot products per tensor forward, one fused a*t + b*g per tensor backward,
see `veil.attacks.inverting`), the per-layer cosine; and `cosine_adjoint`, the same cosine and
its gradient for dummy gradients given as parts without a graph (`veil.models.vit_grads`).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable

from veil.errors import VeilError
from veil.models.base import VeilModel

__all__ = ["GradientTarget"]


class GradientTarget:
    """The observed gradient restricted to parameters the model still has (and to `only`, when
    given); computes dummy gradients."""

    def __init__(self, model: VeilModel, grads: dict[str, Tensor], only: set[str] | None = None) -> None:
        named = [(n, p) for n, p in model.named_parameters() if n in grads and (only is None or n in only)]
        if not named:
            raise VeilError(
                "the observation exports no gradient of this model's parameters; a gradient-matching attack needs some"
            )
        self.model = model
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.target = [grads[n].detach() for n in self.names]
        self.target_sq = sum((t * t).sum() for t in self.target)
        self._flat = [t.reshape(-1) for t in self.target]
        self._norm = float(self.target_sq) ** 0.5
        self._parts: dict[tuple[str, ...], Tensor] = {}

    def dummy_grads(self, loss: Tensor) -> list[Tensor | None]:
        return list(torch.autograd.grad(loss, self.params, create_graph=True, allow_unused=True))

    def l2(self, grads: list[Tensor | None]) -> Tensor:
        return sum(((g - t) ** 2).sum() if g is not None else (t * t).sum() for g, t in zip(grads, self.target))

    def cosine(self, grads: list[Tensor | None], consume: bool = False) -> Tensor:
        """1 - <g', g> / (||g'|| ||g||) over every compared tensor jointly (a missing g'_l counts as 0).

        consume: the backward may overwrite `grads` with its result (the caller never reads them again)."""
        pairs = [(g, t) for g, t in zip(grads, self._flat) if g is not None]
        if not pairs:
            return torch.ones((), dtype=self.target[0].dtype)
        return _Cosine.apply([t for _, t in pairs], self._norm, consume, *[g for g, _ in pairs])

    def cosine_adjoint(self, parts: list[tuple[Tensor, tuple[str, ...]]]) -> tuple[float, list[Tensor]]:
        """`cosine` of dummy gradients given as parts (`veil.models.vit_grads.Part`: a tensor per tuple
        of compared names, their flattened gradients concatenated) and its gradient in each part,
        written over the parts (dF/dg = a t + b g, see `_Cosine`); the parts cover every compared name."""
        targets = []
        for g, names in parts:
            if names not in self._parts:
                flat = dict(zip(self.names, self._flat))
                self._parts[names] = torch.cat([flat[n] for n in names]).view_as(g).to(g.dtype)
            targets.append(self._parts[names])
        if sorted(n for _, ns in parts for n in ns) != sorted(self.names):
            raise VeilError("cosine_adjoint: the parts do not cover the compared parameters exactly")
        value, a, b = _cosine_terms([g for g, _ in parts], targets, self._norm)
        return value, [g.mul_(b / a).add_(t).mul_(a) for (g, _), t in zip(parts, targets)]

    def layer_cosine(self, grads: list[Tensor | None]) -> Tensor:
        """Mean over layers of 1 - cos(g_l, g'_l): every exported tensor weighs the same."""
        # A tensor whose observed gradient is rounding noise (e.g. attention key biases: softmax is
        # shift invariant, so their true gradient is 0) has no direction to match; skip it.
        floor = 1e-6 * max(float(t.norm()) for t in self.target)
        terms = [
            1.0 - (g * t).sum() / (g.norm() * t.norm() + 1e-12)
            for g, t in zip(grads, self.target)
            if g is not None and float(t.norm()) > floor
        ]
        return torch.stack(terms).mean()

    def distance(self, kind: str, grads: list[Tensor | None]) -> Tensor:
        if kind == "cosine":
            return self.cosine(grads)
        if kind == "layer_cosine":
            return self.layer_cosine(grads)
        if kind == "l2":
            return self.l2(grads)
        raise VeilError(f"gradient distance must be 'cosine', 'layer_cosine' or 'l2', got {kind!r}")


def _cosine_terms(grads: list[Tensor], targets: list[Tensor], target_norm: float) -> tuple[float, float, float]:
    """F = 1 - <g, t> / (||g|| ||t|| + 1e-12) over all tensors jointly, and (a, b) of dF/dg = a t + b g."""
    dot = sq = 0.0
    for g, t in zip(grads, targets):
        v = g.reshape(-1)
        dot += float(torch.dot(v, t.reshape(-1)))
        sq += float(torch.dot(v, v))
    norm = sq**0.5
    den = norm * target_norm + 1e-12
    # d(-dot/den)/dg = -t/den + dot * target_norm * g / (norm * den^2)
    return 1.0 - dot / den, -1.0 / den, dot * target_norm / (norm * den * den) if norm > 0 else 0.0


class _Cosine(torch.autograd.Function):
    """F(g) = 1 - <g, t> / (||g|| ||t|| + 1e-12) as one node (see the module docstring). Differentiable
    once: the search differentiates F once, through g, to the image."""

    @staticmethod
    def forward(
        ctx: FunctionCtx, flat_targets: list[Tensor], target_norm: float, consume: bool, *grads: Tensor
    ) -> Tensor:
        targets = [t if t.dtype == g.dtype else t.to(g.dtype) for g, t in zip(grads, flat_targets)]
        value, a, b = _cosine_terms(list(grads), targets, target_norm)
        ctx.save_for_backward(*grads)
        ctx.targets = targets
        ctx.consume = consume
        ctx.coef = (a, b)
        return grads[0].new_tensor(value)

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad: Tensor) -> tuple[Tensor | None, ...]:
        a, b = ctx.coef
        s = float(grad)
        out = []
        for g, t in zip(ctx.saved_tensors, ctx.targets):
            if ctx.consume and g.is_contiguous() and g._base is None:  # g's own storage: no fresh tensor
                out.append(g.mul_(b / a).add_(t.view_as(g)).mul_(a * s))
            else:
                out.append(torch.add(t.view_as(g), g, alpha=b / a).mul_(a * s))
        return (None, None, None, *out)
