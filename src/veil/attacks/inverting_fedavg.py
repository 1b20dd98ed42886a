"""Multi-step Inverting Gradients on a FedAvg update: Geiping et al., NeurIPS 2020, "Inverting
Gradients — How easy is it to break privacy in federated learning?", sec. 5 "Federated averaging".

A FedAvg client sends w_k after s local steps from the global weights w_0, not one gradient. The
attacker simulates those steps on dummy inputs x' (one per private sample, n of them) with labels
ŷ, differentiably, and matches the simulated weight change to the observed one:

  w_{t+1} = U_t(w_t, clip(∇_w L(x'_{B_t}, ŷ_{B_t}; w_t)))          t = 0 .. s-1   (the local steps)
  min_{x' in [0,1]^n}  1 - <Δ(x'), Δ*> / (||Δ(x')|| ||Δ*||)  +  α TV(x')
      Δ(x') = w_0 - w_s(x'),   Δ* = w_0 - w_k   (the paper's cosine + TV objective, eq. 4, with the
                                                 simulated update in place of the gradient)

U_t is the client's optimiser as the server configured it (`Observation.local`, a
`veil.attacks.base.LocalTraining`): SGD, w - τ g (the paper's setting), or AdamW exactly as
`veil.training.loop.make_optimizer` builds it — per-group lr and decoupled weight decay, moments
from zero each round, bias correction, eps outside the square root — after global-norm clipping of
the clean gradient. B_t are the sample slots of step t: the public seeded schedule when the server
knows it (`LocalTraining.order`), else consecutive batches, epoch by epoch. Every step's gradient is
taken with `create_graph=True` (double backward: eager attention), so the whole unrolled local
training is differentiated with respect to x'. Adam on x' (signed gradient, as the paper), box
projection onto [0, 1] after every step, cosine-annealed lr; restarts keep the lowest matching loss.

What is simulated and what is compared. The simulation always runs every parameter the client
trained (the trajectory w_0 .. w_s is then the client's own, to float rounding, given the true
inputs: checked in tests/test_inverting_fedavg.py). `layers` picks which part of Δ enters the
cosine: "input" (default; the patch embedding and position table, as `ig`) or "all" (every
exported tensor, the paper). As for `ig`, the joint cosine over all layers is dominated by large
tensors whose change hardly depends on x', so on these ViTs it leaves the image unconstrained
(figures: docs/results.md, section federated).

Labels: granted (`Knowledge.labels`), or inferred from the update's classifier bias as an
n-sample multiset (`veil.attacks.labels.labels_from_bias`, LLG-style) and dealt to the slots in
order — the attacker cannot know which slot holds which label (`label: infer`); or `label: soft`,
per-slot label logits optimised beside x' (started at the inferred labels; the client's
cross-entropy takes the probabilities as targets). The slot assignment is the bottleneck: with
the right multiset in the wrong slots the images come back far worse than with granted labels
(figures: docs/results.md, section federated). The observed Δ* is read from the observation's pseudo-gradient (w_0 - w_k) / (τ s):
the cosine does not see the scale.

Scope: a naive attacker — it simulates neither the defense's batch transform (MJP), nor its
gradient noise or per-sample clipping (DP-SGD, AEGIS), nor FedProx's proximal term; dropout is off
in the simulation (eval mode). Adaptive variants would add them to `LocalSimulator.delta`. Labels
inferred from an AdamW update's bias change are unreliable (Adam normalises each coordinate, so the
change is not proportional to the label counts): where labels are wrong, the figure understates a
stronger attacker that searches the slot assignment (not in veil). On a single gradient (`kind="gradient"`) it is plain IG: use `ig`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor
from torch.func import functional_call

from veil.attacks import ATTACKS
from veil.attacks.base import Attack, Knowledge, LocalTraining, Observation, Reconstruction
from veil.attacks.inverting import CosineTVOptions, image_shape, input_layer_names, total_variation
from veil.attacks.labels import labels_from_bias
from veil.attacks.options import option
from veil.defenses.base import Defense
from veil.errors import VeilError
from veil.models.base import VeilModel


def step_slots(local: LocalTraining) -> list[Tensor]:
    """The sample slots of each local step: `local.order`, else consecutive batches per epoch."""
    if local.order is not None:
        slots = [torch.as_tensor(s, dtype=torch.long) for s in local.order]
    else:
        n, b = local.samples, local.batch_size
        epoch = [torch.arange(i, min(i + b, n)) for i in range(0, n, b)]
        slots = (epoch * max(1, local.epochs))[: local.steps]
    if len(slots) != local.steps or any(int(s.max()) >= local.samples for s in slots if s.numel()):
        raise VeilError(
            f"ig-fedavg: the local schedule ({len(slots)} steps over {local.samples} samples) does not match the update's {local.steps} steps"
        )
    return slots


class LocalSimulator:
    """The client's local training as a differentiable function of the dummy inputs. The simulated
    parameters live in one flat vector (the optimiser's arithmetic is a few ops per step, not a
    few per tensor); the model runs on views of it (`torch.func.functional_call`)."""

    def __init__(self, model: VeilModel, names: list[str], local: LocalTraining) -> None:
        if local.optimizer not in ("adamw", "sgd"):
            raise VeilError(f"ig-fedavg: optimizer must be 'adamw' or 'sgd', got {local.optimizer!r}")
        self.model, self.names, self.local = model, names, local
        state = dict(model.named_parameters())
        self.shapes = [state[n].shape for n in names]
        self.sizes = [state[n].numel() for n in names]
        self.start = torch.cat([state[n].detach().flatten() for n in names])
        self.fixed = {k: v.detach() for k, v in {**dict(model.named_buffers()), **state}.items() if k not in set(names)}
        hyper = [local.groups.get(n, (local.lr, 0.0)) for n in names]
        self.lr = torch.cat([torch.full((k,), h[0]) for k, h in zip(self.sizes, hyper)])
        self.decay = torch.cat([torch.full((k,), 1.0 - h[0] * h[1]) for k, h in zip(self.sizes, hyper)])
        self.slots = step_slots(local)

    def select(self, names: list[str]) -> Tensor:
        """Indices into the flat vector of the parameters `names` (the compared layers)."""
        offsets = dict(zip(self.names, torch.tensor([0, *self.sizes]).cumsum(0).tolist()))
        size = dict(zip(self.names, self.sizes))
        return torch.cat([torch.arange(offsets[n], offsets[n] + size[n]) for n in names])

    def unflat(self, flat: Tensor) -> list[Tensor]:
        return [t.view(s) for t, s in zip(flat.split(self.sizes), self.shapes)]

    def loss(self, w: Tensor, x: Tensor, y: Tensor) -> Tensor:
        batch = {"pixels": x, "labels": y}
        logits = functional_call(self.model, {**self.fixed, **dict(zip(self.names, self.unflat(w)))}, (batch,))
        return self.model.loss(logits, batch)

    def delta(self, x: Tensor, labels: Tensor) -> Tensor:
        """w_0 - w_s after the s simulated local steps (flat, in `names` order)."""
        w = self.start.clone().requires_grad_(True)  # a leaf: step 1 differentiates at w_0
        w0, m, v = w, torch.zeros_like(w), torch.zeros_like(w)
        b1, b2 = self.local.betas
        for t, idx in enumerate(self.slots, start=1):
            (g,) = torch.autograd.grad(self.loss(w, x[idx], labels[idx]), w, create_graph=True)
            if self.local.clip:  # torch.nn.utils.clip_grad_norm_: scale by min(1, c / (||g|| + 1e-6))
                g = g * torch.clamp(self.local.clip / (g.norm() + 1e-6), max=1.0)
            if self.local.optimizer == "sgd":
                w = w - self.lr * g
                continue
            m = b1 * m + (1 - b1) * g
            v = b2 * v + (1 - b2) * g * g
            c1, c2 = 1 - b1**t, (1 - b2**t) ** 0.5
            # sqrt at v = 0 has an infinite derivative; the floor changes w only where |g| < 1e-15
            w = w * self.decay - (self.lr / c1) * m / (v.clamp_min(1e-30).sqrt() / c2 + self.local.eps)
        return self.start - w if w is not w0 else torch.zeros_like(w)


def optimizer_groups(
    model: VeilModel, lr: float, weight_decay: float, defenses: Sequence[Defense] = ()
) -> dict[str, tuple[float, float]]:
    """{parameter name: (lr, weight decay)} of the client's AdamW, read off the optimiser veil's
    clients build (`veil.training.loop.make_optimizer`): the server configured lr and weight decay
    and knows the defenses' lr scales, so it can rebuild the groups exactly."""
    from veil.training.loop import make_optimizer

    name = {id(p): n for n, p in model.named_parameters()}
    opt = make_optimizer(model, lr, weight_decay, defenses)
    return {name[id(p)]: (float(g["lr"]), float(g["weight_decay"])) for g in opt.param_groups for p in g["params"]}


def cosine_distance(a: Tensor, b: Tensor) -> Tensor:
    return 1.0 - (a * b).sum() / (a.norm() * b.norm() + 1e-12)


@dataclass(frozen=True)
class IGFedAvgOptions(CosineTVOptions):
    iterations: int = option(100, "Adam steps per restart (each one unrolls the client's local training)")
    restarts: int = option(1, "random restarts; the one with the lowest matching loss is kept")
    lr: float = option(0.1, "Adam learning rate on the dummy inputs (cosine-annealed to lr/1000)")
    label: Literal["infer", "soft"] = option(
        "infer", "without granted labels: the bias-inferred multiset dealt in order, or soft labels optimised"
    )
    layers: Literal["input", "all"] = option("input", "part of the weight change compared: input layers or all")


class MultiStepInvertingGradients(Attack[IGFedAvgOptions]):
    """Inverting Gradients that simulates the client's s local steps (Geiping et al. 2020, sec. 5).

    Budget: `iterations` x `restarts` evaluations of the unrolled local training (each s forward +
    double-backward passes over the client's batches). `layers`: "all" parameters the update
    exports (the paper) or "input" (the patch embedding and position table, as `ig`; the default).
    The simulation runs all trained parameters either way; `layers` only picks the compared part.
    """

    modality = "image"
    observes = frozenset({"delta", "schedule"})
    protocol_why = "it simulates a client's multi-step FedAvg round; a single gradient is ig's"
    knows = (
        "the FedAvg update, the weights, and the local training the server configured (optimizer, lr, steps, batch size, "
        "epochs, sample count, public batch schedule); not the defense (naive)"
    )
    #: label "soft": per-slot label logits optimised with x' (plain Adam, this lr), started at the inferred labels
    label_lr = 0.1

    def names(self, obs: Observation) -> list[str]:
        exported = [n for n, p in obs.model.named_parameters() if n in obs.grads]
        if self.options.layers == "input":
            only = input_layer_names(obs.model, obs.grads)
            return [n for n in exported if n in only] or exported
        return exported

    def labels(self, obs: Observation, know: Knowledge, n: int) -> Tensor:
        if know.labels is not None:
            return know.labels.long().reshape(-1)[:n]
        head = obs.model.classifier()
        if getattr(head, "bias", None) is None or not obs.has_grad(head, "bias"):
            raise VeilError("ig-fedavg: inferring labels needs the classifier bias in the update")
        return labels_from_bias(obs.grad(head, "bias"), n)

    def _reconstruct(self, obs: Observation, know: Knowledge) -> Reconstruction:
        local = obs.local
        if obs.kind != "delta" or local is None:
            raise VeilError(
                "ig-fedavg simulates a multi-step FedAvg update (kind='delta' with the local training); "
                "on a single gradient use ig"
            )
        model, names = obs.model, self.names(obs)
        trained = [n for n, p in model.named_parameters() if p.requires_grad and n in obs.grads]
        sim = LocalSimulator(model, trained, local)  # every parameter the client trained: the trajectory is exact
        compared = sim.select(names)
        target = torch.cat([obs.grads[n].detach().float().flatten() for n in names])
        labels = self.labels(obs, know, local.samples)
        shape = (local.samples, *image_shape(model, know))
        seed = self.options.seed
        gen = torch.Generator().manual_seed(int(know.seed if seed is None else seed))
        was_training = model.training
        model.eval()
        best: tuple[float, Tensor, Tensor] | None = None
        soft = know.labels is None and self.options.label == "soft"
        t0 = time.perf_counter()
        try:
            for _ in range(self.options.restarts):
                loss, x, y = self.run_once(sim, compared, target, shape, labels, gen, soft)
                if best is None or loss < best[0]:
                    best = (loss, x, y)
        finally:
            model.train(was_training)
        assert best is not None
        its = self.options.iterations * self.options.restarts
        return Reconstruction(
            images=best[1].clamp(0, 1),
            labels=best[2],
            stats={
                "loss": best[0],
                "iterations": its,
                "local_steps": local.steps,
                "samples": local.samples,
                "iterations_per_second": its / max(time.perf_counter() - t0, 1e-9),
                "matched": len(names),
                "work": {"iterations": its},  # every restart runs its iterations out
                "budget_stopped": True,
            },
        )

    def budget(self) -> dict[str, int]:
        """Unrolled-training evaluations (Adam iterations) over all restarts."""
        return {"iterations": self.options.iterations * self.options.restarts}

    def run_once(
        self,
        sim: LocalSimulator,
        compared: Tensor,
        target: Tensor,
        shape: tuple[int, ...],
        labels: Tensor,
        gen: torch.Generator,
        soft: bool = False,
    ) -> tuple[float, Tensor, Tensor]:
        """One restart; with `soft`, the slots' labels are probabilities softmax(L) optimised beside x'
        (the client's cross-entropy takes them as targets), L started at 2 x one-hot of the inferred ones."""
        its, tv, lr = self.options.iterations, self.options.tv, self.options.lr
        x = torch.rand(shape, generator=gen).requires_grad_(True)
        groups: list[dict] = [{"params": [x], "lr": lr}]
        logits = None
        if soft:
            classes = int(sim.model.classifier().weight.shape[0])
            logits = (2.0 * torch.nn.functional.one_hot(labels, classes).float()).requires_grad_(True)
            groups.append({"params": [logits], "lr": self.label_lr})
        opt = torch.optim.Adam(groups)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, max(its, 1), eta_min=lr * 1e-3)

        def slot_labels() -> Tensor:
            return labels if logits is None else logits.softmax(-1)

        for _ in range(its):
            opt.zero_grad()
            loss = cosine_distance(sim.delta(x, slot_labels())[compared], target) + tv * total_variation(x)
            loss.backward()
            x.grad.sign_()
            opt.step()
            sched.step()
            with torch.no_grad():
                x.clamp_(0.0, 1.0)
        with torch.enable_grad():
            final = float(cosine_distance(sim.delta(x, slot_labels())[compared], target).detach())
        return final, x.detach(), labels if logits is None else logits.detach().argmax(-1)


ATTACKS.register(
    "ig-fedavg",
    "Inverting Gradients on a multi-step FedAvg update: simulates the client's local steps "
    "(its optimizer, lr, batches) on dummy inputs (Geiping et al. 2020, sec. 5)",
)(MultiStepInvertingGradients)

__all__ = ["IGFedAvgOptions", "MultiStepInvertingGradients", "LocalSimulator", "optimizer_groups", "step_slots"]
