"""Frozen-encoder features, computed once: parameter-efficient (DP) fine-tuning of the head alone.

When only the classifier trains (``dpsgd(trainable=classifier)``: DP linear probing, Yu et al.,
ICLR 2022; Tramèr & Boneh, ICLR 2021, "Differentially Private Learning Needs Better Features"),
the frozen encoder maps each training sample to the same input of the classifier every epoch:

    logits_i = W h(x_i) + b,     h = the frozen encoder up to the classifier's input

so `train.frozen_features: true` computes h(x_i) once for the training split and trains the head
on it: each step costs the head's forward and backward instead of the whole encoder's forward.
The training batch holds the features under `FEATURES` (and the labels); the model's forward
sends such a batch straight to its classifier (`VeilModel.forward`). Every other part of the step
is unchanged: Poisson batches over the same N samples, the defense's per-sample clipping and noise
on the same parameters, the accountant; test evaluation runs the whole model on the raw inputs.

It is exact only while h is a function of the sample alone, so it is refused (one line saying
why) when a parameter outside the classifier trains, when a dropout before the head is active
(p > 0), for language-model tasks, and under any defense that changes the forward or the batch
(every defense but DP-SGD: MJP shuffles tokens, AEGIS noises gradients of frozen layers, ...).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from veil.defenses.base import Defense
from veil.defenses.dpsgd_engines import micro_batches
from veil.errors import VeilError
from veil.models.base import FEATURES, VeilModel


def refusal(model: VeilModel, defenses: Sequence[Defense]) -> str | None:
    """Why `model` cannot train on cached features under `defenses`, or None when it can."""
    if model.task != "classification":
        return f"it needs a classification model (this one's task is {model.task!r})"
    other = [d.name for d in defenses if not d.keeps_forward]
    if other:
        return f"defense {other[0]} changes the forward or the batch (allowed: defenses that keep it, e.g. dpsgd)"
    head = {id(p) for p in model.classifier().parameters()}
    outside = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in head]
    if outside:
        return f"parameters outside the classifier train ({outside[0]}, ...); freeze them (e.g. dpsgd trainable: classifier)"
    if not any(p.requires_grad for p in model.classifier().parameters()):
        return "nothing trains"
    inside = {id(m) for m in model.classifier().modules()}
    drop = [n for n, m in model.named_modules() if isinstance(m, nn.Dropout) and m.p > 0 and id(m) not in inside]
    if drop:
        return f"dropout {drop[0]} is active before the head (set model.dropout: 0)"
    return None


@torch.no_grad()
def encoder_features(
    model: VeilModel, split: dict[str, Tensor], batch_size: int, device: torch.device, progress: bool = True
) -> Tensor:
    """The classifier's input for every sample of `split` (N, D), in the split's order; text
    batches are grouped by length and cut to their longest sample."""
    captured: list[Tensor] = []
    hook = model.classifier().register_forward_pre_hook(lambda m, args: captured.append(args[0].detach()))
    was = model.training
    model.eval()
    try:
        inputs = {k: v for k, v in split.items() if k != "labels"}
        parts, order = micro_batches(inputs, batch_size)
        for part in tqdm(parts, desc="frozen features", unit="batch", disable=not progress, leave=False):
            model({k: v.to(device) for k, v in part.items()})
    finally:
        hook.remove()
        model.train(was)
    feats = torch.cat(captured)
    if order is None:
        return feats
    out = torch.empty_like(feats)
    out[order.to(feats.device)] = feats
    return out


def feature_split(
    model: VeilModel,
    split: dict[str, Tensor],
    defenses: Sequence[Defense],
    batch_size: int,
    device: torch.device,
    progress: bool = True,
) -> dict[str, Tensor]:
    """The training split as the head sees it: {FEATURES: (N, D), "labels": (N,)}; a one-line error
    when the cache would change what is trained."""
    why = refusal(model, defenses)
    if why is not None:
        raise VeilError(f"train.frozen_features: {why}")
    return {FEATURES: encoder_features(model, split, batch_size, device, progress).cpu(), "labels": split["labels"]}


__all__ = ["encoder_features", "feature_split", "refusal"]
