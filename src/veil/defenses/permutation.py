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
    `after_receive(features, state)` un-permutes with the stored keys. With `enabled=False` both
    are the identity (the zero-strength setting). Features may carry `skip` leading slots (e.g. a
    [CLS] token) that are never moved.
    """

    name = "permutation"
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
        return self._apply(features, state["keys"], unpermute)

    def _apply(self, x: Tensor, keys: Tensor, fn: Any) -> Tensor:
        if self.skip == 0:
            return fn(x, keys)
        return torch.cat([x[:, : self.skip], fn(x[:, self.skip :], keys)], dim=1)

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "enabled": self.enabled, "keys": "fresh per sample, kept on the client"}


DEFENSES.register("permutation", "p-FeSTA: shuffle patch features per sample with a client-only key (split learning)")(
    PatchPermutation
)
