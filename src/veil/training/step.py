"""One client step under a list of defenses — the single place where a gradient is made.

The same masked gradient drives the local optimiser step and the exported update: defenses
rewrite ``p.grad`` in place *before* both, so no clean gradient reaches either.

Order: backward -> global norm clipping of the CLEAN gradient -> every defense's gradient
transform -> export and optimiser step. Clipping after a defense would rescale its noise
together with the signal: AEGIS's embedding noise alone can be orders of magnitude larger than
the clean gradient, so a clip to 1.0 after it would shrink the clean parameters' gradients below
Adam's epsilon and stall them. A defense that replaces the backward pass (DP-SGD) clips per
sample itself; the global clip is not applied on top of its noise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from veil.defenses.base import Defense
from veil.models.base import Batch, VeilModel


@dataclass
class StepResult:
    loss: float
    logits: Tensor
    #: what the client exports: parameter name -> gradient (after every defense)
    grads: dict[str, Tensor] | None


def compute_loss(model: VeilModel, batch: Batch, defenses: list[Defense]) -> tuple[Tensor, Tensor]:
    logits = model(batch)
    loss = model.loss(logits, batch)
    for d in defenses:
        extra = d.aux_loss(model, batch, logits)
        if extra is not None:
            loss = loss + extra
    return loss, logits


def defended_backward(
    model: VeilModel, batch: Batch, defenses: list[Defense], step: int = 0, clip: float | None = None
) -> tuple[Tensor, Tensor]:
    """Forward, backward, clipping (clean gradient) and every defense's gradient transform;
    leaves the result in ``p.grad``."""
    custom = [d for d in defenses if d.backward is not None]
    if len(custom) > 1:
        raise ValueError(f"two defenses replace the backward pass: {[d.name for d in custom]}")
    if custom:
        loss, logits = custom[0].backward(model, batch, lambda b: compute_loss(model, b, defenses))
    else:
        loss, logits = compute_loss(model, batch, defenses)
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], clip)
    for d in defenses:
        d.transform_grads(model, step)
    return loss, logits


def exported_grads(model: VeilModel) -> dict[str, Tensor]:
    """The client's update as the server receives it: every trainable parameter's gradient."""
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}


def client_step(
    model: VeilModel,
    batch: Batch,
    defenses: list[Defense],
    optimizer: torch.optim.Optimizer | None = None,
    step: int = 0,
    clip: float | None = None,
    export: bool = True,
) -> StepResult:
    """Zero grads, defended backward (clipping the clean gradient), export, optimiser step."""
    model.zero_grad(set_to_none=True)
    loss, logits = defended_backward(model, batch, defenses, step, clip)
    grads = exported_grads(model) if export else None
    if optimizer is not None:
        optimizer.step()
    return StepResult(float(loss.detach()), logits.detach(), grads)
