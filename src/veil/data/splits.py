"""`DataSplits` and the tensor-dict helpers every loader shares: split, limit, subset, batch.

A split is a plain ``dict[str, Tensor]`` with the batch keys the models read, so a batch of it
can go straight into ``model(batch)`` and any slice of it is again a split.

A loader declares its options as a frozen dataclass (`Limits` and `PoolLimits` hold the ones every
loader shares) and is registered through `loader`, which exposes the fields as its keyword
options: the config's `data.*` keys, listed with their help by `veil list --details NAME`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

import numpy as np
import torch
from torch import Tensor

from veil.errors import VeilError
from veil.schema import options_of

Split = dict[str, Tensor]


@dataclass
class DataSplits:
    """A train and a test split of one data set, plus what a model needs to fit it."""

    train: Split
    test: Split
    num_classes: int
    class_names: list[str]
    modality: str  # "image" or "text"
    meta: dict[str, Any] = field(default_factory=dict)

    def __repr__(self) -> str:
        shapes = {k: tuple(v.shape) for k, v in self.train.items()}
        return (
            f"DataSplits({self.modality}, classes={self.num_classes}, train={split_size(self.train)}, "
            f"test={split_size(self.test)}, keys={shapes})"
        )


def split_size(split: Split) -> int:
    """Number of samples in a split; all tensors must agree (a mismatch is a bug, not user input)."""
    sizes = {len(v) for v in split.values()}
    if len(sizes) != 1:
        raise ValueError(f"split tensors disagree in length: { {k: len(v) for k, v in split.items()} }")
    return sizes.pop()


def subset(split: Split, indices: Sequence[int] | np.ndarray | Tensor) -> Split:
    """The samples at `indices`, in that order (e.g. one federated client's share)."""
    idx = torch.as_tensor(np.asarray(indices, dtype=np.int64))
    return {k: v[idx] for k, v in split.items()}


def iterate_batches(
    split: Split,
    batch_size: int,
    shuffle: bool = False,
    generator: torch.Generator | None = None,
    drop_last: bool = False,
) -> Iterator[Split]:
    """Yield consecutive batches; with `shuffle`, in an order drawn from `generator` (repeatable)."""
    if batch_size < 1:
        raise VeilError(f"batch_size must be at least 1, got {batch_size}")
    n = split_size(split)
    order = torch.randperm(n, generator=generator) if shuffle else torch.arange(n)
    stop = n - n % batch_size if drop_last else n
    for start in range(0, stop, batch_size):
        yield subset(split, order[start : start + batch_size])


def stratified_split(labels: np.ndarray, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Seeded train/test indices keeping each class's share (at least one test sample per class
    that has two or more samples). Vectorised: rank each sample inside its class in a random order."""
    if not 0.0 < test_fraction < 1.0:
        raise VeilError(f"test_fraction must be between 0 and 1 (exclusive), got {test_fraction}")
    labels = np.asarray(labels)
    rng = np.random.default_rng(seed)
    perm = rng.permutation(len(labels))
    order = perm[np.argsort(labels[perm], kind="stable")]  # grouped by class, random inside
    classes, starts, counts = np.unique(labels[order], return_index=True, return_counts=True)
    rank = np.arange(len(order)) - np.repeat(starts, counts)
    n_test = np.where(counts > 1, np.clip(np.round(counts * test_fraction), 1, counts - 1), 0)
    is_test = rank < np.repeat(n_test, counts)
    train, test = order[~is_test], order[is_test]
    return rng.permutation(train), rng.permutation(test)


def limit(split: Split, size: int | None, seed: int, what: str) -> Split:
    """A seeded random `size` samples of the split (all of it when `size` is None)."""
    if size is None:
        return split
    n = split_size(split)
    if size < 1:
        raise VeilError(f"{what} must be at least 1, got {size}")
    if size > n:
        raise VeilError(f"{what} {size} is larger than the {n} samples available")
    pick = np.random.default_rng(seed).permutation(n)[:size]
    return subset(split, pick)


@dataclass(frozen=True, kw_only=True)
class Limits:
    """The split limits every loader takes.

    train_size: training examples kept, a seeded random subset (unset: all).
    test_size: test examples kept, a seeded random subset (unset: all).
    seed: seed of the split and of the subsets.
    """

    train_size: int | None = None
    test_size: int | None = None
    seed: int = 0


@dataclass(frozen=True, kw_only=True)
class PoolLimits(Limits):
    """The limits of a loader that splits one pool of examples into train and test.

    test_fraction: share of the examples held out as the test split (stratified by label, seeded).
    """

    test_fraction: float = 0.2


OptionsT = TypeVar("OptionsT")


def loader(options: type[OptionsT]) -> Callable[[Callable[[OptionsT], DataSplits]], Callable[..., DataSplits]]:
    """Decorator: the data set ``load(options) -> DataSplits`` as the keyword factory the registry
    calls with the config's `data.*` keys (the fields of `options`, declared as the factory's
    ``options``: `Registry.create` refuses any other in one line); `schema()` lists them with their
    types, defaults and help."""
    allowed = frozenset(f.name for f in fields(options))  # type: ignore[arg-type]

    def wrap(load: Callable[[OptionsT], DataSplits]) -> Callable[..., DataSplits]:
        def factory(**settings: Any) -> DataSplits:
            return load(options(**settings))

        factory.__name__ = factory.__qualname__ = load.__name__
        factory.__doc__ = load.__doc__
        factory.options = allowed  # type: ignore[attr-defined]
        factory.schema = lambda: _own_first(options)  # type: ignore[attr-defined]
        return factory

    return wrap


def _own_first(options: type) -> dict[str, Any]:
    """`options_of(options)` with each loader's own options first, the shared limits last (a field
    ranks by the nearest class of `options`' MRO that declares it)."""
    found = options_of(options)
    mro = options.__mro__
    rank = {n: next(i for i, c in enumerate(mro) if n in vars(c).get("__annotations__", {})) for n in found}
    return {n: found[n] for n in sorted(found, key=lambda n: rank[n])}
