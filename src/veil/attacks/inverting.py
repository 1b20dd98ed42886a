"""Optimisation-based image inversion: DLG (Zhu et al., NeurIPS 2019, "Deep Leakage from
Gradients") and Inverting Gradients (Geiping et al., NeurIPS 2020).

Both search for a dummy batch x' (and label) whose gradient matches the observed one, g = dL/dθ:

  DLG:  min_{x', y'}  sum_l || dL(x', softmax(y'))/dθ_l - g_l ||^2
        (L-BFGS or Adam; y' is a free soft label unless the label is known or inferred)

  IG:   min_{x' in [0,1]}  1 - <∇θ L(x', y), g> / (||∇θ L(x', y)|| ||g||)  +  α TV(x')
        (cosine over all layers jointly; TV(x) = mean |x_{i+1,j} - x_{ij}| + mean |x_{i,j+1} - x_{ij}|;
        Adam on the signed gradient, lr decayed ×0.1 at 3/8, 5/8, 7/8 of the iterations; several
        restarts, the one with the lowest gradient loss kept; at batch 1 the label is read from the
        last layer's gradient, see `veil.attacks.labels`).

Gradients are compared on every parameter the update exports (θ_l in the observation), the
dummy gradient is taken with `create_graph=True` (double backward, eager attention). The model
runs in eval mode during the search (dropout off): the attacker cannot replay the client's masks.
"""
from __future__ import annotations

import time
from typing import Callable

import torch
from torch import Tensor

from veil.attacks import ATTACKS
from veil.attacks.base import Attack, Knowledge, Observation, Reconstruction
from veil.attacks.labels import recover_labels
from veil.errors import VeilError
from veil.models.base import VeilModel


class GradientTarget:
    """The observed gradient restricted to parameters the model still has; computes dummy gradients."""

    def __init__(self, model: VeilModel, grads: dict[str, Tensor]) -> None:
        named = [(n, p) for n, p in model.named_parameters() if n in grads]
        if not named:
            raise VeilError("the observation exports no gradient of this model's parameters; a gradient-matching attack needs some")
        self.model = model
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.target = [grads[n].detach() for n in self.names]
        self.target_sq = sum((t * t).sum() for t in self.target)

    def dummy_grads(self, loss: Tensor) -> list[Tensor | None]:
        return list(torch.autograd.grad(loss, self.params, create_graph=True, allow_unused=True))

    def l2(self, grads: list[Tensor | None]) -> Tensor:
        return sum(((g - t) ** 2).sum() if g is not None else (t * t).sum() for g, t in zip(grads, self.target))

    def cosine(self, grads: list[Tensor | None]) -> Tensor:
        dot = sum((g * t).sum() for g, t in zip(grads, self.target) if g is not None)
        norm = sum((g * g).sum() for g in grads if g is not None)
        return 1.0 - dot / (norm.sqrt() * self.target_sq.sqrt() + 1e-12)

    def layer_cosine(self, grads: list[Tensor | None]) -> Tensor:
        """Mean over layers of 1 - cos(g_l, g'_l): every exported tensor weighs the same."""
        terms = [1.0 - (g * t).sum() / (g.norm() * t.norm() + 1e-12) for g, t in zip(grads, self.target) if g is not None and t.abs().sum() > 0]
        return torch.stack(terms).mean()

    def distance(self, kind: str, grads: list[Tensor | None]) -> Tensor:
        if kind == "cosine":
            return self.cosine(grads)
        if kind == "layer_cosine":
            return self.layer_cosine(grads)
        if kind == "l2":
            return self.l2(grads)
        raise VeilError(f"gradient distance must be 'cosine', 'layer_cosine' or 'l2', got {kind!r}")


def total_variation(x: Tensor) -> Tensor:
    return (x[..., 1:, :] - x[..., :-1, :]).abs().mean() + (x[..., :, 1:] - x[..., :, :-1]).abs().mean()


def image_shape(model: VeilModel, know: Knowledge) -> tuple[int, int, int]:
    if know.input_shape:
        return tuple(know.input_shape)[-3:]  # type: ignore[return-value]
    from veil.attacks.analytic_vit import patch_geometry

    _, chans, size = patch_geometry(model)
    return chans, size, size


def soft_cross_entropy(logits: Tensor, label_logits: Tensor) -> Tensor:
    return -(label_logits.softmax(-1) * logits.log_softmax(-1)).sum(-1).mean()


class _Inversion(Attack):
    """Shared loop: restarts, timing, label handling; subclasses define one restart."""

    modality = "image"
    defaults: dict = {}

    def opt(self, key: str):  # noqa: ANN201 - setting of any type
        return self.settings.get(key, self.defaults[key])

    def labels_for(self, obs: Observation, know: Knowledge, B: int) -> Tensor | None:
        if know.labels is not None:
            return know.labels.long().reshape(-1)[:B]
        if self.opt("label") == "infer":
            return recover_labels(obs, B)
        return None  # optimise a soft label (DLG)

    def _reconstruct(self, obs: Observation, know: Knowledge) -> Reconstruction:
        model = obs.model
        B = int(know.batch_size or 1)
        shape = (B, *image_shape(model, know))
        target = GradientTarget(model, obs.grads)
        labels = self.labels_for(obs, know, B)
        gen = torch.Generator().manual_seed(int(self.opt("seed") if "seed" in self.settings else know.seed))
        was_training = model.training
        model.eval()
        best: tuple[float, Tensor, Tensor | None] | None = None
        steps, t0 = 0, time.perf_counter()
        try:
            for _ in range(int(self.opt("restarts"))):
                loss, x, y, n = self.run_once(model, target, shape, labels, gen)
                steps += n
                if best is None or loss < best[0]:
                    best = (loss, x, y)
        finally:
            model.train(was_training)
        elapsed = time.perf_counter() - t0
        assert best is not None
        return Reconstruction(images=best[1].detach().clamp(0, 1), labels=best[2],
                              stats={"loss": best[0], "iterations": steps, "restarts": int(self.opt("restarts")),
                                     "iterations_per_second": steps / max(elapsed, 1e-9)})

    def run_once(self, model: VeilModel, target: GradientTarget, shape: tuple[int, ...], labels: Tensor | None,
                 gen: torch.Generator) -> tuple[float, Tensor, Tensor | None, int]:
        raise NotImplementedError


def _forward_loss(model: VeilModel, x: Tensor, labels: Tensor | None, label_logits: Tensor | None) -> Tensor:
    if labels is not None:
        batch = {"pixels": x, "labels": labels}
        return model.loss(model(batch), batch)
    return soft_cross_entropy(model({"pixels": x}), label_logits)  # type: ignore[arg-type]


def _num_classes(model: VeilModel) -> int:
    head = model.classifier()
    return int(head.out_features if hasattr(head, "out_features") else head.weight.shape[0])


class DLG(_Inversion):
    """DLG: L2 gradient distance, L-BFGS (or Adam) on a dummy image and a soft label."""

    name = "dlg"
    defaults = {"iterations": 300, "restarts": 1, "optimizer": "lbfgs", "lr": 1.0, "label": "soft", "seed": 0}

    def run_once(self, model, target, shape, labels, gen):  # noqa: ANN001, ANN201 - see base
        x = torch.rand(shape, generator=gen).requires_grad_(True)
        params = [x]
        y = None
        if labels is None:
            y = torch.randn(shape[0], _num_classes(model), generator=gen).requires_grad_(True)
            params.append(y)

        def objective() -> Tensor:
            return target.l2(target.dummy_grads(_forward_loss(model, x, labels, y)))

        n = _optimise(params, objective, self.opt("optimizer"), float(self.opt("lr")), int(self.opt("iterations")))
        with torch.enable_grad():
            final = float(objective().detach())
        rec_labels = labels if y is None else y.detach().argmax(-1)
        return final, x.detach(), rec_labels, n


def _optimise(params: list[Tensor], objective: Callable[[], Tensor], kind: str, lr: float, iterations: int) -> int:
    """Run `iterations` optimiser steps; returns how many gradient evaluations were made."""
    evals = 0
    if kind == "lbfgs":
        opt = torch.optim.LBFGS(params, lr=lr, max_iter=1, history_size=100, line_search_fn="strong_wolfe")

        def closure() -> Tensor:
            nonlocal evals
            opt.zero_grad()
            loss = objective()
            loss.backward()
            evals += 1
            return loss

        for _ in range(iterations):
            opt.step(closure)
        return evals
    if kind != "adam":
        raise VeilError(f"dlg: optimizer must be 'lbfgs' or 'adam', got {kind!r}")
    opt = torch.optim.Adam(params, lr=lr)
    for _ in range(iterations):
        opt.zero_grad()
        objective().backward()
        opt.step()
    return iterations


class InvertingGradients(_Inversion):
    """Inverting Gradients: cosine gradient distance + total variation, Adam, restarts."""

    name = "ig"
    defaults = {"iterations": 1000, "restarts": 2, "lr": 0.1, "tv": 1e-2, "label": "infer", "signed": True, "seed": 0,
                "distance": "cosine"}

    def run_once(self, model, target, shape, labels, gen):  # noqa: ANN001, ANN201 - see base
        if labels is None:
            raise VeilError("ig needs labels: pass them in the knowledge or keep label=infer")
        its, tv, dist = int(self.opt("iterations")), float(self.opt("tv")), str(self.opt("distance"))
        x = torch.rand(shape, generator=gen).requires_grad_(True)
        opt = torch.optim.Adam([x], lr=float(self.opt("lr")))
        sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[its * 3 // 8, its * 5 // 8, its * 7 // 8], gamma=0.1)
        for _ in range(its):
            opt.zero_grad()
            loss = target.distance(dist, target.dummy_grads(_forward_loss(model, x, labels, None))) + tv * total_variation(x)
            loss.backward()
            if self.opt("signed"):
                x.grad.sign_()
            opt.step()
            sched.step()
            with torch.no_grad():
                x.clamp_(0.0, 1.0)
        final = float(target.distance(dist, target.dummy_grads(_forward_loss(model, x, labels, None))).detach())
        return final, x.detach(), labels, its


ATTACKS.register("dlg", "DLG: L2 gradient matching with L-BFGS on a dummy image and soft label (Zhu et al. 2019)")(DLG)
ATTACKS.register("ig", "Inverting Gradients: cosine gradient matching + TV, Adam, restarts (Geiping et al. 2020)")(InvertingGradients)

__all__ = ["DLG", "InvertingGradients", "GradientTarget", "total_variation"]
