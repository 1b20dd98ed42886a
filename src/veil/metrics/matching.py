"""Hungarian matching of reconstructed batch items to the originals they came from.

A gradient-inversion attack recovers a *set* of inputs: item ``j`` of the reconstruction need
not correspond to item ``j`` of the original batch. Before scoring, we pair them with the
minimum-cost one-to-one assignment (the Hungarian / Kuhn-Munkres algorithm; Kuhn 1955,
Munkres 1957), as in the gradient-inversion literature (e.g. Geiping et al. 2020; Balunovic
et al. 2022, LAMP). The solver is ``scipy.optimize.linear_sum_assignment``; a rectangular cost
matrix (a reconstruction with more or fewer items than the original) is allowed, in which case
``min(n_original, n_reconstruction)`` pairs are returned.

Also home to `MetricInputError`, the error every metric raises on bad input: it is both a
`ValueError` and a `veil.errors.VeilError`, so the CLI reports it as one line.
"""

from __future__ import annotations

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment

from veil.errors import VeilError

__all__ = ["MetricInputError", "hungarian_match", "order_from_match"]


class MetricInputError(VeilError, ValueError):
    """Bad input to a metric (shape mismatch, empty batch, wrong type, non-finite values)."""


def hungarian_match(cost: np.ndarray | torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Minimum-cost one-to-one matching of originals (rows) to reconstructions (columns).

    Args:
        cost: ``(n_original, n_reconstruction)`` matrix; ``cost[i, j]`` is the cost of pairing
            original ``i`` with reconstruction ``j`` (e.g. MSE, or negative ROUGE-L). It may be
            rectangular.

    Returns:
        ``(rows, cols)``: int64 arrays of equal length ``min(n_original, n_reconstruction)``;
        original ``rows[k]`` is paired with reconstruction ``cols[k]``. ``rows`` is increasing.

    Raises:
        MetricInputError: if ``cost`` is not a 2-D, non-empty matrix of finite numbers.
    """
    if isinstance(cost, torch.Tensor):
        cost = cost.detach().to("cpu", torch.float64).numpy()
    arr = np.asarray(cost, dtype=np.float64)
    if arr.ndim != 2:
        raise MetricInputError(f"hungarian_match: cost must be a 2-D matrix, got shape {arr.shape}")
    if arr.size == 0:
        raise MetricInputError(f"hungarian_match: cost matrix is empty (shape {arr.shape})")
    if not np.isfinite(arr).all():
        raise MetricInputError("hungarian_match: cost matrix contains NaN or infinite entries")
    rows, cols = linear_sum_assignment(arr)
    return rows.astype(np.int64), cols.astype(np.int64)


def order_from_match(rows: np.ndarray, cols: np.ndarray, n_original: int) -> list[int]:
    """For each original ``i``, the index of its matched reconstruction, or ``-1`` if unmatched."""
    order = np.full(n_original, -1, dtype=np.int64)
    order[np.asarray(rows, dtype=np.int64)] = np.asarray(cols, dtype=np.int64)
    return order.tolist()
