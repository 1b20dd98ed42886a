"""The defense protocol: a privacy mechanism that attaches to an existing model (Opacus style).

A defense may implement any of these hooks; the client step (`veil.training.step`) calls them:

  aux_loss(model, batch, logits)  an extra loss term (e.g. MJP's DAL / DRL)
  backward(model, batch, loss_fn) replaces `loss.backward()` (e.g. DP-SGD per-sample clipping);
                                  sets ``p.grad`` and returns (loss, logits)
  transform_grads(model, step)    rewrites `p.grad` in place after backward, before the optimiser
                                  step AND before export: one masked gradient serves both
  before_send / after_receive     split learning: features leaving / returning to the client
  lr_scales(model)                per-parameter learning-rate factors for the local optimiser
                                  (e.g. AEGIS: parameters whose gradient is mostly its noise)

`attach` keeps the handles it installs, refuses to attach twice, and `detach` removes them.
A defense with zero strength leaves training bit-identical to no defense.

``secret``: client-held entropy (an integer, or None) that a defense mixes into every random draw
it makes beside its ``seed`` (noise, permutation keys). The federated client sets it from a secret
the server never sees (`veil.federated.client_secret`); without it the draws follow the seed alone, and
whoever knows the config (the server does) can regenerate them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from veil.errors import VeilError
from veil.models.base import Batch, VeilModel


class Defense:
    name: str = "none"
    #: the defense reads the batch only through the model's forward and changes neither (no batch or
    #: embedding transform, no extra loss): training on cached frozen features is exact under it
    keeps_forward: bool = False
    #: the models this defense supports, by modality; an unsupported model is a one-line error
    modalities: tuple[str, ...] = ("image", "text")

    def __init__(self) -> None:
        self.model: VeilModel | None = None
        self.secret: int | None = None

    # ---- lifecycle ------------------------------------------------------------------------
    def attach(self, model: VeilModel) -> Defense:
        if self.model is not None:
            raise VeilError(f"defense {self.name!r} is already attached to a model; detach it first")
        if model.modality not in self.modalities:
            raise VeilError(
                f"defense {self.name!r} does not support {model.modality} models; it supports: {', '.join(self.modalities)}"
            )
        self.model = model
        self._attach(model)
        return self

    def detach(self) -> None:
        if self.model is not None:
            self._detach(self.model)
        self.model = None

    def _attach(self, model: VeilModel) -> None:
        """Install hooks, parameters or transforms on `model`."""

    def _detach(self, model: VeilModel) -> None:
        """Remove everything `_attach` installed."""

    # ---- hooks (identity by default) -------------------------------------------------------
    def aux_loss(self, model: VeilModel, batch: Batch, logits: Tensor) -> Tensor | None:
        return None

    #: (model, batch, loss_fn) -> (loss, logits); sets p.grad in place of `loss.backward()`
    backward: Callable[..., tuple[Tensor, Tensor]] | None = None

    def transform_grads(self, model: VeilModel, step: int) -> None:
        return None

    def before_send(self, features: Tensor, state: dict[str, Any]) -> Tensor:
        return features

    def after_receive(self, features: Tensor, state: dict[str, Any]) -> Tensor:
        return features

    def lr_scales(self, model: VeilModel) -> list[tuple[torch.nn.Parameter, float]]:
        """(parameter, factor) pairs: the local optimiser steps these at ``factor * lr``."""
        return []

    def describe(self) -> dict[str, Any]:
        """The settings an adaptive attacker is granted (`Knowledge.defense`)."""
        return {"name": self.name}

    def settings_of(self, *names: str) -> dict[str, Any]:
        """``{"name": self.name, n: self.n for n in names}``: the settings `describe` grants by name."""
        return {"name": self.name, **{n: getattr(self, n) for n in names}}

    # ---- exact resume ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Tensor]:
        """The random-stream state a resumed run needs to draw what the uninterrupted run would
        have drawn (call counters, generator states, pooled draws), as named tensors; the training
        loop saves it with every checkpoint. Stateless defenses return nothing."""
        return {}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        """Restore what `state_dict` returned, after `attach` and before the first resumed step."""
        if state:
            raise VeilError(f"defense {self.name!r} keeps no resume state, but the checkpoint holds {sorted(state)}")


class KeyedNoiseDefense(Defense):
    """A defense whose noise is keyed on (seed, step, call count): the count is its resume state,
    so a resumed run draws the noise the uninterrupted run would have drawn, never a replay."""

    def __init__(self) -> None:
        super().__init__()
        self._calls = 0

    def state_dict(self) -> dict[str, Tensor]:
        return {"calls": torch.tensor(self._calls, dtype=torch.int64)}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        self._calls = int(state["calls"])


def check_seed(seed: Any, none_means: str | None = None) -> int | None:
    """An integer seed (bool is not one), or None where the defense gives it a meaning
    (`none_means`, said in the error); anything else is a one-line error."""
    if seed is None and none_means is not None:
        return None
    if isinstance(seed, bool) or not isinstance(seed, int):
        allowed = "an integer" if none_means is None else f"an integer or null ({none_means})"
        raise VeilError(f"seed must be {allowed}, got {seed!r}")
    return seed


class NoDefense(Defense):
    """No defense: the reference every defense is compared with."""


def check_unit_interval(name: str, value: float) -> float:
    if not (0.0 <= float(value) <= 1.0):
        raise VeilError(f"{name} must be in [0, 1], got {value}")
    return float(value)
