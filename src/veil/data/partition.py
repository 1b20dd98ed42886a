"""Splitting a data set's indices among federated clients: IID, or label-skewed by a Dirichlet
draw, and a number that says how skewed a partition is.

All three are vectorised over samples (no per-sample Python loops) and seeded.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from torch import Tensor

from veil.errors import VeilError

Labels = Sequence[int] | np.ndarray | Tensor


def as_labels(labels: Labels) -> np.ndarray:
    """Integer labels as a 1-D NumPy array."""
    if isinstance(labels, Tensor):
        labels = labels.detach().cpu().numpy()
    arr = np.asarray(labels)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise VeilError(f"labels must be a 1-D array of integers, got shape {arr.shape} and dtype {arr.dtype}")
    return arr.astype(np.int64)


def check_clients(n: int, num_clients: int, min_size: int = 1) -> None:
    """Enough samples for every client."""
    if num_clients < 1:
        raise VeilError(f"num_clients must be at least 1, got {num_clients}")
    if n < num_clients * min_size:
        raise VeilError(f"{n} samples cannot give each of {num_clients} clients at least {min_size}")


def iid(labels: Labels, num_clients: int, seed: int = 0) -> list[np.ndarray]:
    """A seeded shuffle cut into `num_clients` near-equal parts (sizes differ by at most one)."""
    y = as_labels(labels)
    check_clients(len(y), num_clients)
    perm = np.random.default_rng(seed).permutation(len(y))
    return [np.sort(p) for p in np.array_split(perm, num_clients)]


def dirichlet(
    labels: Labels, num_clients: int, alpha: float, seed: int = 0, min_size: int = 1, max_tries: int = 1000
) -> list[np.ndarray]:
    """Label skew: each class's samples go to clients in proportions drawn from Dir(alpha);
    small alpha gives each client few classes. Redrawn until every client has `min_size`."""
    if alpha <= 0:
        raise VeilError(f"alpha must be positive, got {alpha}")
    y = as_labels(labels)
    check_clients(len(y), num_clients, min_size)
    rng = np.random.default_rng(seed)
    classes, class_counts = np.unique(y, return_counts=True)
    for _ in range(max_tries):
        props = rng.dirichlet(np.full(num_clients, float(alpha)), size=len(classes))  # (K, C)
        counts = rng.multinomial(class_counts, props)  # (K, C): samples of class k for client c
        if counts.sum(0).min() >= min_size:
            break
    else:
        raise VeilError(
            f"could not give each of {num_clients} clients {min_size} samples with alpha={alpha} "
            f"in {max_tries} draws; raise alpha or lower min_size"
        )
    perm = rng.permutation(len(y))
    by_class = perm[np.argsort(y[perm], kind="stable")]  # class blocks, random order inside
    owner = np.repeat(np.tile(np.arange(num_clients), len(classes)), counts.ravel())
    order = np.argsort(owner, kind="stable")
    bounds = np.cumsum(np.bincount(owner, minlength=num_clients))[:-1]
    return [np.sort(p) for p in np.split(by_class[order], bounds)]


def label_skew(parts: Sequence[np.ndarray], labels: Labels) -> float:
    """Mean total-variation distance between each non-empty client's label distribution and the
    global one: 0 for perfectly balanced clients, near 1 when each holds one rare class."""
    y = as_labels(labels)
    k = int(y.max()) + 1
    sizes = np.array([len(p) for p in parts])
    owner = np.repeat(np.arange(len(parts)), sizes)
    idx = np.concatenate([np.asarray(p, dtype=np.int64) for p in parts]) if len(parts) else np.zeros(0, np.int64)
    hist = np.bincount(owner * k + y[idx], minlength=len(parts) * k).reshape(len(parts), k)
    keep = sizes > 0
    local = hist[keep] / sizes[keep, None]
    glob = np.bincount(y, minlength=k) / len(y)
    return float(0.5 * np.abs(local - glob).sum(1).mean())
