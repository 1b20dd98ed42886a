"""Edge-continuity jigsaw solver: place a set of patches into the empty slots of a partly known grid.

Used by `april-mjp` to put MJP's masked patches, recovered as a set, back among the masked slots.
Compatibility is the sum of squared differences of abutting edge pixels (SSD, as in Cho et al.,
CVPR 2010, "A probabilistic image jigsaw puzzle solver"; Pomeranz et al. 2011 use its L_p form):

    D_right(a, b) = || a[:, :, -1] - b[:, :, 0] ||^2      a left of b
    D_down(a, b)  = || a[:, -1, :] - b[:, 0, :] ||^2      a above b

and the placement minimises the total over every grid edge that touches an empty slot:

    min_pi  sum_{(s, t, dir) in edges}  D_dir(patch at s, patch at t).

It is a quadratic assignment problem; the solver starts from the Hungarian assignment of the unary
part (edges to known neighbours only) and improves it by best-improvement pairwise swaps, every
candidate swap scored at once. With every empty slot surrounded by known patches the unary
part is the whole cost and the Hungarian step is exact.
"""

from __future__ import annotations

import torch
from torch import Tensor

from veil.metrics.matching import hungarian_match


def grid_edges(H: int, W: int) -> Tensor:
    """(E, 3) long: (slot s, slot t, dir) for every horizontal (dir 0, t right of s) and vertical
    (dir 1, t below s) neighbour pair of an H x W grid in row-major order."""
    idx = torch.arange(H * W).view(H, W)
    right = torch.stack([idx[:, :-1].flatten(), idx[:, 1:].flatten(), torch.zeros((W - 1) * H, dtype=torch.long)], 1)
    down = torch.stack([idx[:-1].flatten(), idx[1:].flatten(), torch.ones((H - 1) * W, dtype=torch.long)], 1)
    return torch.cat([right, down])


def edge_costs(patches: Tensor) -> Tensor:
    """(2, n, n): [0, a, b] = SSD of a's right edge and b's left edge; [1, a, b] = a's bottom vs b's top.

    patches: (n, C, p, p)."""
    x = patches.double()
    right = torch.cdist(x[..., :, -1].flatten(1), x[..., :, 0].flatten(1)) ** 2
    down = torch.cdist(x[..., -1, :].flatten(1), x[..., 0, :].flatten(1)) ** 2
    return torch.stack([right, down])


def place(patches: Tensor, empty: Tensor, grid: tuple[int, int], max_rounds: int | None = None) -> Tensor:
    """(N,) long assignment ``slot -> patch index``: the known slots keep their own patch, the empty
    slots receive a permutation of the patches found at the empty slots.

    patches: (N, C, p, p) in slot (row-major) order; empty: (N,) bool."""
    N = patches.shape[0]
    assign = torch.arange(N)
    holes = torch.nonzero(empty).flatten()
    m = holes.numel()
    if m < 2:
        return assign
    cost = edge_costs(patches)
    edges = grid_edges(*grid)
    edges = edges[empty[edges[:, 0]] | empty[edges[:, 1]]]  # only edges that touch a hole vary
    unary = _unary(cost, edges, empty, holes)  # (m candidates, m holes)
    rows, cols = hungarian_match(unary)
    assign[holes[torch.as_tensor(cols)]] = holes[torch.as_tensor(rows)]
    pairs = torch.combinations(torch.arange(m), 2)  # (K, 2) candidate swaps among the holes
    for _ in range(max_rounds if max_rounds is not None else 4 * m):
        trial = assign.expand(pairs.shape[0], N).clone()
        a, b = holes[pairs[:, 0]], holes[pairs[:, 1]]
        k = torch.arange(pairs.shape[0])
        trial[k, a], trial[k, b] = assign[b], assign[a]
        totals = _total(cost, edges, trial)
        best = int(totals.argmin())
        if float(totals[best]) >= float(_total(cost, edges, assign[None])[0]) - 1e-12:
            break
        assign = trial[best]
    return assign


def _unary(cost: Tensor, edges: Tensor, empty: Tensor, holes: Tensor) -> Tensor:
    """(m, m): cost of candidate patch holes[i] at hole holes[j] from the edges to known neighbours."""
    m = holes.numel()
    where = torch.full((empty.numel(),), -1, dtype=torch.long)
    where[holes] = torch.arange(m)
    out = torch.zeros(m, m, dtype=cost.dtype)
    s, t, d = edges.unbind(1)
    left_hole = empty[s] & ~empty[t]  # hole s, known t to its right / below: D(cand, t)
    out.index_add_(1, where[s[left_hole]], cost[d[left_hole], :, t[left_hole]][:, holes].t())
    right_hole = ~empty[s] & empty[t]  # known s, hole t: D(s, cand)
    out.index_add_(1, where[t[right_hole]], cost[d[right_hole], s[right_hole]][:, holes].t())
    return out


def _total(cost: Tensor, edges: Tensor, assign: Tensor) -> Tensor:
    """(K,) total edge cost of K assignments (K, N)."""
    s, t, d = edges.unbind(1)
    return cost[d, assign[:, s], assign[:, t]].sum(1)
