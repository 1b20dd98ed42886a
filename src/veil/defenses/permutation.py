"""p-FeSTA's permutation module (Park et al., "Multi-Task Distributed Learning using Vision
Transformer with Random Patch Permutation", Fig. 1B / 4, Alg. 1).

The client shuffles the N patch features of every sample with its own fresh random key before
they leave (``h~_b = h_b[pi_b]``, pi_b a uniform permutation of {0..N-1}, one per sample), keeps
the key, and un-shuffles what comes back (``b_b = b~_b[pi_b^{-1}]``); the backward pass applies
the same maps in reverse (the gradient of a gather is a scatter: ``g~ = g[pi]`` going up).
Because every Transformer body component (self-attention without positional terms, the MLP,
LayerNorm) is permutation-equivariant, ``B(h[pi]) = B(h)[pi]`` (the [CLS] slot, not permuted,
is invariant), so training is unchanged while the server never sees the patches in order; the
position embedding was already added on the client, so the server cannot subtract it either.

The keys live only in the client's `state` mapping (in split learning: Flower's per-node
`Context.state`), never in a message.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from veil.defenses import DEFENSES
from veil.defenses.base import Defense
from veil.defenses.noise import torch_seed
from veil.errors import VeilError
from veil.models.base import VeilModel


def fresh_keys(batch: int, tokens: int, generator: torch.Generator) -> Tensor:
    """(batch, tokens) int64: an independent uniform permutation per sample (argsort of noise)."""
    return torch.rand(batch, tokens, generator=generator).argsort(dim=1)


def permute(x: Tensor, keys: Tensor) -> Tensor:
    """x (B, N, D) -> x[b, keys[b]]: slot j of the result holds token keys[b, j]."""
    return x.gather(1, keys.unsqueeze(-1).expand(-1, -1, x.shape[-1]))


def unpermute(x: Tensor, keys: Tensor) -> Tensor:
    """Inverse of `permute`: scatter slot j back to token keys[b, j]."""
    return torch.empty_like(x).scatter(1, keys.unsqueeze(-1).expand(-1, -1, x.shape[-1]), x)


class PatchPermutation(Defense):
    """Split learning: shuffle patch features before sending, un-shuffle on receipt.

    `before_send(features, state)` draws fresh keys (seeded by `seed` and a counter kept in
    `state`, and by the client-held `secret` when one is set), stores them in `state["keys"]` and returns the permuted features;
    `after_receive(features, state)` un-permutes with the stored keys; features that come back with
    more slots than the keys (the body's output: [CLS] first) keep the extra leading slots in place.
    It is a gather / scatter, so autograd through it re-permutes the gradient going back up. With
    `enabled=False` both are the identity (the zero-strength setting). Features sent may carry
    `skip` leading slots (e.g. a [CLS] token) that are never moved.

    A feature defense: split learning drives it (`veil.federated.split`); attaching it to a model
    (`veil train`, FedAvg) is refused, since there it would do nothing.
    """

    modalities = ("image",)

    def __init__(self, enabled: bool = True, seed: int = 0, skip: int = 0) -> None:
        super().__init__()
        self.enabled, self.seed, self.skip = bool(enabled), int(seed), int(skip)

    def before_send(self, features: Tensor, state: dict[str, Any]) -> Tensor:
        if not self.enabled:
            return features
        count = int(state.get("calls", 0))
        g = torch.Generator().manual_seed(
            self.seed * 1_000_003 + count if self.secret is None else torch_seed((self.seed, count), self.secret)
        )
        keys = fresh_keys(features.shape[0], features.shape[1] - self.skip, g)
        state["keys"], state["calls"] = keys, count + 1
        return self._apply(features, keys, permute)

    def after_receive(self, features: Tensor, state: dict[str, Any]) -> Tensor:
        if not self.enabled:
            return features
        keys = state["keys"]
        lead = features.shape[1] - keys.shape[1]
        if lead < 0:
            raise VeilError(f"permutation: {features.shape[1]} slots came back for keys of {keys.shape[1]} tokens")
        return self._apply(features, keys, unpermute, lead)

    def _apply(self, x: Tensor, keys: Tensor, fn: Any, lead: int | None = None) -> Tensor:
        lead = self.skip if lead is None else lead
        if lead == 0:
            return fn(x, keys)
        return torch.cat([x[:, :lead], fn(x[:, lead:], keys)], dim=1)

    def _attach(self, model: VeilModel) -> None:
        raise VeilError(
            "defense 'permutation' acts on split learning's features (p-FeSTA), not on a model; "
            "run it with veil split and split.protocol=pfesta"
        )

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "enabled": self.enabled, "keys": "fresh per sample, kept on the client"}


DEFENSES.register("permutation", "p-FeSTA: shuffle patch features per sample with a client-only key (split learning)")(
    PatchPermutation
)
