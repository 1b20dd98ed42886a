"""Optimisation-based image inversion: DLG (Zhu et al., NeurIPS 2019, "Deep Leakage from
Gradients") and Inverting Gradients (Geiping et al., NeurIPS 2020).

Both search for a dummy batch x' (and label) whose gradient matches the observed one, g = dL/dθ:

  DLG:  min_{x', y'}  sum_l || dL(x', softmax(y'))/dθ_l - g_l ||^2
        (L-BFGS or Adam; y' is a free soft label unless the label is known or inferred)

  IG:   min_{x' in [0,1]}  1 - <∇θ L(x', y), g> / (||∇θ L(x', y)|| ||g||)  +  α TV(x')
        (cosine over the compared layers jointly; TV(x) = mean |x_{i+1,j} - x_{ij}| + mean |x_{i,j+1} - x_{ij}|;
        Adam on the signed gradient, x projected onto the box [0, 1] after every step, lr decayed
        (cosine, or the paper's ×0.1 at 3/8, 5/8, 7/8); several restarts, the one with the lowest
        gradient loss kept; at batch 1 the label is read from the last layer's gradient, see
        `veil.attacks.labels`).

DLG compares every parameter the update exports (θ_l in the observation); IG by default the
input layers only (`layers="input"`, see `InvertingGradients`), or all of them. The dummy
gradient is taken with `create_graph=True` (double backward, eager attention). The model runs
in eval mode during the search (dropout off): the attacker cannot replay the client's masks.

Cost of one IG step (the same objective, computed leanly): the second backward asks for the
image's gradient only (`autograd.grad(loss, x)`; `loss.backward()` would also build the
second-order gradient of every weight, which the search never reads), and the cosine is one
autograd node (`_Cosine`): its forward reduces each dummy gradient with two dot products, no
weight-sized temporaries, and its backward writes dF/dg_l = a t_l + b g_l in one tensor per layer,
a = -1 / (||g|| ||t||), b = <g, t> / (||g||^3 ||t||), where autograd's elementwise graph would
write five; in the search loop (`consume=True`) it writes them over the dummy gradients
themselves, which nothing reads after that backward (`veil.attacks.gradient_target`).

On veil's own ViT (`ViTGrads.supports`) the cosine IG step skips autograd altogether
(`engine="auto"`, the default; `engine="autograd"` forces the path above): `veil.models.vit_grads`
computes the dummy gradient and its adjoint by hand, the same function to float rounding, so the
signed steps are the same. `benchmarks/ig_vs_breaching.py` measures the step against breaching's.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, TypeVar

import torch
from torch import Tensor

from veil.attacks import ATTACKS
from veil.attacks.base import Attack, Knowledge, Observation, Reconstruction, work_bar
from veil.attacks.gradient_target import GradientTarget
from veil.attacks.labels import recover_labels
from veil.attacks.options import Options, option
from veil.errors import VeilError
from veil.models.base import VeilModel
from veil.models.vit_grads import ViTGrads


def total_variation(x: Tensor) -> Tensor:
    return (x[..., 1:, :] - x[..., :-1, :]).abs().mean() + (x[..., :, 1:] - x[..., :, :-1]).abs().mean()


def _tv_grad(x: Tensor) -> Tensor:
    """d total_variation / dx."""
    with torch.enable_grad():
        leaf = x.detach().requires_grad_(True)
        (g,) = torch.autograd.grad(total_variation(leaf), [leaf])
    return g


def image_shape(model: VeilModel, know: Knowledge) -> tuple[int, int, int]:
    if know.input_shape:
        return tuple(know.input_shape)[-3:]  # type: ignore[return-value]
    from veil.attacks.analytic_vit import patch_geometry

    _, chans, size = patch_geometry(model)
    return chans, size, size


def soft_cross_entropy(logits: Tensor, label_logits: Tensor) -> Tensor:
    return -(label_logits.softmax(-1) * logits.log_softmax(-1)).sum(-1).mean()


@dataclass(frozen=True)
class DLGOptions(Options):
    iterations: int = option(300, "optimiser iterations per restart (L-BFGS: one call running them all)")
    restarts: int = option(1, "random restarts; the one with the lowest gradient distance is kept")
    optimizer: Literal["lbfgs", "adam"] = option("lbfgs", "optimiser of the dummy image (and soft label)")
    lr: float = option(1.0, "optimiser learning rate")
    label: Literal["soft", "infer"] = option(
        "soft", "without granted labels: optimise a soft label, or infer it from the last layer's gradient"
    )
    seed: int | None = option(None, "seed of the dummy's start; unset: the knowledge's seed")


@dataclass(frozen=True)
class CosineTVOptions(Options):
    """What the attacks that minimise the paper's cosine + TV objective (Geiping et al. 2020,
    eq. 4) on dummy images share: `ig` on a gradient, `ig-fedavg` on a FedAvg update."""

    tv: float = option(1e-4, "weight of the total-variation prior (keep it small next to the cosine)")
    seed: int | None = option(None, "seed of the dummies' start; unset: the knowledge's seed")


@dataclass(frozen=True)
class IGOptions(CosineTVOptions):
    iterations: int = option(800, "Adam steps per restart")
    restarts: int = option(2, "random restarts; the one with the lowest gradient distance is kept")
    lr: float = option(0.1, "Adam learning rate (annealed by the schedule)")
    label: Literal["infer"] = option("infer", "without granted labels, read them off the last layer's gradient")
    signed: bool = option(True, "step on the sign of the image gradient (the paper)")
    distance: Literal["cosine", "layer_cosine", "l2"] = option("cosine", "gradient distance matched")
    layers: Literal["input", "all"] = option("input", "gradients compared: the input layers or every exported one")
    schedule: Literal["cosine", "step"] = option("cosine", "lr schedule: cosine to lr/1000, or x0.1 at 3/8, 5/8, 7/8")
    engine: Literal["auto", "autograd"] = option(
        "auto", "auto: veil's ViT with the cosine takes the hand-written step (veil.models.vit_grads); autograd: always"
    )


_InversionOptionsT = TypeVar("_InversionOptionsT", DLGOptions, IGOptions)


class _Inversion(Attack[_InversionOptionsT]):
    """Shared loop: restarts, timing, label handling; subclasses define one restart."""

    modality = "image"
    observes = frozenset({"gradient", "delta"})

    def labels_for(self, obs: Observation, know: Knowledge, B: int) -> Tensor | None:
        if know.labels is not None:
            return know.labels.long().reshape(-1)[:B]
        if self.options.label == "infer":
            return recover_labels(obs, B)
        return None  # optimise a soft label (DLG)

    def _reconstruct(self, obs: Observation, know: Knowledge) -> Reconstruction:
        model = obs.model
        B = int(know.batch_size or 1)
        shape = (B, *image_shape(model, know))
        target = self.target_for(model, obs)
        labels = self.labels_for(obs, know, B)
        dev = next(model.parameters()).device  # the dummies live beside the weights (cuda when the model is there)
        labels = labels.to(dev) if labels is not None else None
        seed = self.options.seed
        gen = torch.Generator().manual_seed(int(know.seed if seed is None else seed))
        was_training = model.training
        model.eval()
        best: tuple[float, Tensor, Tensor | None] | None = None
        steps, t0 = 0, time.perf_counter()
        self._bar = work_bar(self.options.iterations * self.options.restarts, self.name)
        try:
            for restart in range(self.options.restarts):
                loss, x, y, n = self.run_once(model, target, shape, labels, gen, restart)
                steps += n
                if best is None or loss < best[0]:
                    best = (loss, x, y)
        finally:
            self._bar.close()
            model.train(was_training)
        elapsed = time.perf_counter() - t0
        assert best is not None
        return Reconstruction(
            images=best[1].detach().clamp(0, 1).cpu(),
            labels=best[2].cpu() if best[2] is not None else None,
            stats={
                "loss": best[0],
                "iterations": steps,
                "restarts": self.options.restarts,
                "iterations_per_second": steps / max(elapsed, 1e-9),
                "matched": len(target.names),
                "work": {"iterations": steps},
                # every restart ran its iterations out (L-BFGS may converge before: then it did not)
                "budget_stopped": steps >= self.options.iterations * self.options.restarts,
            },
        )

    def budget(self) -> dict[str, int]:
        """Optimiser iterations over all restarts."""
        return {"iterations": self.options.iterations * self.options.restarts}

    def target_for(self, model: VeilModel, obs: Observation) -> GradientTarget:
        return GradientTarget(model, obs.grads)

    def run_once(
        self,
        model: VeilModel,
        target: GradientTarget,
        shape: tuple[int, ...],
        labels: Tensor | None,
        gen: torch.Generator,
        restart: int,
    ) -> tuple[float, Tensor, Tensor | None, int]:
        raise NotImplementedError


def _forward_loss(model: VeilModel, x: Tensor, labels: Tensor | None, label_logits: Tensor | None) -> Tensor:
    if labels is not None:
        batch = {"pixels": x, "labels": labels}
        return model.loss(model(batch), batch)
    return soft_cross_entropy(model({"pixels": x}), label_logits)  # type: ignore[arg-type]


def _num_classes(model: VeilModel) -> int:
    head = model.classifier()
    return int(head.out_features if hasattr(head, "out_features") else head.weight.shape[0])


class DLG(_Inversion[DLGOptions]):
    """DLG: L2 gradient distance, L-BFGS (or Adam) on a dummy image and a soft label."""

    knows = "the update, the weights, batch size and input shape (labels if granted); not the defense (naive)"

    def run_once(self, model, target, shape, labels, gen, restart):  # noqa: ANN001, ANN201 - see base
        dev = next(model.parameters()).device  # drawn on the CPU generator: the same start on any device
        x = torch.rand(shape, generator=gen).to(dev).requires_grad_(True)
        params = [x]
        y = None
        if labels is None:
            y = torch.randn(shape[0], _num_classes(model), generator=gen).to(dev).requires_grad_(True)
            params.append(y)

        def objective() -> Tensor:
            return target.l2(target.dummy_grads(_forward_loss(model, x, labels, y)))

        o = self.options
        n = _optimise(params, objective, o.optimizer, o.lr, o.iterations)
        self._bar.update(n)
        with torch.enable_grad():
            final = float(objective().detach())
        rec_labels = labels if y is None else y.detach().argmax(-1)
        return final, x.detach(), rec_labels, n


def strong_wolfe_lbfgs(
    params: list[Tensor], iterations: int, lr: float, history: int, tolerances: tuple[float, float]
) -> torch.optim.LBFGS:
    """L-BFGS that runs all `iterations` in one ``step(closure)`` call, with the strong-Wolfe line
    search and up to 5/4 evaluations per iteration (`max_eval`); `tolerances` are (grad, change)."""
    return torch.optim.LBFGS(
        params,
        lr=lr,
        max_iter=iterations,
        max_eval=iterations * 5 // 4,
        history_size=history,
        tolerance_grad=tolerances[0],
        tolerance_change=tolerances[1],
        line_search_fn="strong_wolfe",
    )


def _optimise(params: list[Tensor], objective: Callable[[], Tensor], kind: str, lr: float, iterations: int) -> int:
    """Run at most `iterations` optimiser steps; returns how many ran (L-BFGS may converge first;
    its line search makes up to 5/4 evaluations per iteration, `max_eval`)."""
    evals = 0
    if kind == "lbfgs":
        # One call runs all the iterations: with max_iter=1 per call, torch's strong-Wolfe search
        # gets max_eval - 1 = 0 trial points, rejects every step, and x never leaves its start.
        opt = strong_wolfe_lbfgs(params, iterations, lr, history=100, tolerances=(1e-10, 1e-12))

        def closure() -> Tensor:
            nonlocal evals
            opt.zero_grad()
            loss = objective()
            loss.backward()
            evals += 1
            return loss

        if iterations > 0:
            opt.step(closure)
        return int(opt.state[params[0]].get("n_iter", 0)) if evals else 0
    if kind != "adam":
        raise VeilError(f"dlg: optimizer must be 'lbfgs' or 'adam', got {kind!r}")
    opt = torch.optim.Adam(params, lr=lr)
    for _ in range(iterations):
        opt.zero_grad()
        objective().backward()
        opt.step()
    return iterations


def input_layer_names(model: VeilModel, exported: dict[str, Tensor]) -> set[str]:
    """Exported parameters of the layers that touch the input: the patch (or token) embedding's
    weight and bias and the position table. At batch 1 their gradients hold the image linearly
    (dL/dW_patch = G^T X, dL/dpos = G), the part of the update that depends on x most directly."""
    ids = set()
    with contextlib.suppress(NotImplementedError):
        ids |= {id(p) for p in model.token_embedding().parameters()}
    with contextlib.suppress(NotImplementedError):
        ids.add(id(model.position_table()))
    return {n for n, p in model.named_parameters() if id(p) in ids and n in exported}


class InvertingGradients(_Inversion[IGOptions]):
    """Inverting Gradients: cosine gradient distance + total variation, signed Adam, restarts.

    `layers` picks the gradients compared (Geiping et al.'s own code offers layer subsets such as
    the first layers): "all" (every exported tensor, the paper's default) or "input" (the input
    layers, `input_layer_names`; falls back to all when the update exports none of them). On the
    ViTs here the joint cosine over all layers is dominated by large tensors (value/output/MLP
    weights, the head) whose gradients hardly depend on the image at init, so a blocky image can
    match them closely and still be far from the input; the input layers pin the image down.
    `schedule`: "cosine" (lr annealed to lr/1000; the default, steadier at a few hundred iterations)
    or "step" (the paper's ×0.1 at 3/8, 5/8, 7/8). `tv` must stay small next to the cosine: with
    signed steps a pixel follows whichever term dominates its gradient's sign, and near a match the
    cosine's gradient is tiny, so a weight such as tv=1e-2 flattens the digit into blocks.
    """

    knows = "the update, the weights, batch size and input shape (labels if granted); not the defense (naive)"

    def target_for(self, model: VeilModel, obs: Observation) -> GradientTarget:
        if self.options.layers == "all":
            return GradientTarget(model, obs.grads)
        return GradientTarget(model, obs.grads, only=input_layer_names(model, obs.grads) or None)

    def run_once(self, model, target, shape, labels, gen, restart):  # noqa: ANN001, ANN201 - see base
        if labels is None:
            raise VeilError("ig needs labels: pass them in the knowledge or keep label=infer")
        o = self.options
        its, tv, dist = o.iterations, o.tv, o.distance
        x = torch.rand(shape, generator=gen).to(next(model.parameters()).device).requires_grad_(True)
        opt = torch.optim.Adam([x], lr=o.lr)
        if o.schedule == "cosine":
            sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, max(its, 1), eta_min=o.lr * 1e-3)
        else:
            sched = torch.optim.lr_scheduler.MultiStepLR(
                opt, milestones=[its * 3 // 8, its * 5 // 8, its * 7 // 8], gamma=0.1
            )
        fast = None
        if o.engine == "auto" and dist == "cosine" and ViTGrads.supports(model):
            fast = ViTGrads(model, set(target.names))
        for _ in range(its):
            if fast is not None:  # the same objective and image gradient, no autograd graph (vit_grads)
                _, bars = target.cosine_adjoint(fast.grads(x.detach(), labels))
                grad = fast.image_grad(bars).add_(_tv_grad(x), alpha=tv)
            else:
                dummy = target.dummy_grads(_forward_loss(model, x, labels, None))
                match = target.cosine(dummy, consume=True) if dist == "cosine" else target.distance(dist, dummy)
                del dummy  # consumed by the backward below
                loss = match + tv * total_variation(x)
                (grad,) = torch.autograd.grad(loss, [x])  # the image's gradient only (module docstring)
            x.grad = grad.sign_() if o.signed else grad
            opt.step()
            sched.step()
            with torch.no_grad():
                x.clamp_(0.0, 1.0)
            self._bar.update(1)
        final = float(target.distance(dist, target.dummy_grads(_forward_loss(model, x, labels, None))).detach())
        return final, x.detach(), labels, its


ATTACKS.register("dlg", "DLG: L2 gradient matching with L-BFGS on a dummy image and soft label (Zhu et al. 2019)")(DLG)
ATTACKS.register("ig", "Inverting Gradients: cosine gradient matching + TV, Adam, restarts (Geiping et al. 2020)")(
    InvertingGradients
)

__all__ = ["DLG", "DLGOptions", "GradientTarget", "IGOptions", "InvertingGradients", "total_variation"]
