"""Token-wise jigsaw puzzle shuffle (Alg. 1 of the MJP paper, `mjp-masked-jigsaw-puzzle.txt`).

Every function works on a whole batch at once (no Python loop over tokens or sequences):

* `select_random(movable, gamma)`: per row, a ratio ``gamma`` of the movable slots.
* `select_blocks(B, grid, gamma)`: BEiT-style block-wise selection on the patch grid: rectangles
  of random area and aspect ratio, unioned until the target count, then topped up at random.
* `select_windows(movable, gamma, window)`: the text n-gram variant (Eq. 6): the sequence is cut
  into non-overlapping windows of ``window`` slots and each window selects its own share.
* `jigsaw(selected, window)`: a random permutation of the selected slots among themselves
  (restricted to each window when ``window`` is given); returns an index map ``perm`` so that
  ``shuffled[:, j] = tokens[:, perm[:, j]]``. Unselected slots map to themselves.

Counts use stochastic rounding (``floor(gamma * n + u)``, u ~ U[0, 1)) so the expected share is
exactly ``gamma`` even on the 16-patch grid of ``vit-digits``, where ``gamma = 0.03`` would
otherwise always round to zero. ``gamma = 0`` selects nothing, ever.

A shuffle of fewer than two slots moves nothing, and so does a permutation that happens to be the
identity; both would let a client believe it is protected while its update is undefended. With
``least = MIN_SELECTED`` (what MJP passes) every row with ``gamma > 0`` selects at least two
movable slots (per sequence; with windows, its largest window takes them), and `jigsaw` replaces
an identity draw by a cyclic shift of the selected slots, so at least two tokens move whenever
``gamma > 0`` and two slots are movable. On a 16-patch grid this raises gamma 0.03 and 0.1 to two
patches per image (0.125).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

MIN_SELECTED = 2  # the fewest slots a shuffle with gamma > 0 selects (one slot cannot move)


def _counts(n: Tensor, gamma: float, g: torch.Generator | None, least: int = 0) -> Tensor:
    """Stochastically rounded ``gamma * n`` per row (never above n; at least min(least, n) if gamma > 0)."""
    u = torch.rand(n.shape, generator=g, device=n.device)
    k = torch.minimum(torch.floor(gamma * n + u), n)
    if least and gamma > 0:
        k = torch.maximum(k, n.clamp(max=least))
    return k.long()


def _rank(keys: Tensor) -> Tensor:
    """Rank (0 = smallest) of every entry along the last dim."""
    return keys.argsort(dim=-1).argsort(dim=-1)


def select_random(movable: Tensor, gamma: float, g: torch.Generator | None = None, least: int = 0) -> Tensor:
    """(..., N) bool: per row, ~gamma of the movable slots chosen uniformly at random (>= least if gamma > 0)."""
    movable = movable.bool()
    return _select(movable, _counts(movable.sum(-1).float(), gamma, g, least), g)


def _select(movable: Tensor, k: Tensor, g: torch.Generator | None) -> Tensor:
    """(..., N) bool: per row, k[...] of the movable slots chosen uniformly at random."""
    keys = torch.rand(movable.shape, generator=g, device=movable.device).masked_fill(~movable, 2.0)
    return (_rank(keys) < k.unsqueeze(-1)) & movable


def select_blocks(
    batch: int,
    grid: tuple[int, int],
    gamma: float,
    g: torch.Generator | None = None,
    device: torch.device | str = "cpu",
    rounds: int = 8,
    min_aspect: float = 0.3,
    least: int = 0,
) -> Tensor:
    """(B, H*W) bool: BEiT block-wise selection of ~gamma*H*W patches per image.

    Each image draws ``rounds`` rectangles (area ~ U[1, target], log-uniform aspect ratio in
    [min_aspect, 1/min_aspect], random position); the longest prefix whose union stays within the
    target is kept, and the remaining count is filled with random patches so every image gets
    exactly its target. All random numbers come from one draw (few ops: this runs every step).
    """
    H, W = grid
    N, R = H * W, rounds
    u = torch.rand(batch, 1 + 4 * R + N, generator=g, device=device)
    k = torch.floor(gamma * N + u[:, :1]).clamp_(max=N)  # (B, 1) target count
    if least and gamma > 0:
        k.clamp_(min=min(least, N))
    area, aspect, ty, tx = u[:, 1 : 1 + 4 * R].view(batch, 4, R).unbind(1)
    area = 1 + area * (k.clamp(min=1) - 1)
    ratio = torch.exp(math.log(min_aspect) * (1 - 2 * aspect))
    h = (area * ratio).sqrt_().round_().clamp_(1, H)
    w = (area / ratio).sqrt_().round_().clamp_(1, W)
    cy = (ty * (H - h + 1)).floor_() + (h - 1) / 2  # block centres
    cx = (tx * (W - w + 1)).floor_() + (w - 1) / 2
    rr, cc = _grid_coords(H, W, device)
    inside = ((rr - cy.unsqueeze(-1)).abs_() <= (h.unsqueeze(-1) - 1) / 2) & (
        (cc - cx.unsqueeze(-1)).abs_() <= (w.unsqueeze(-1) - 1) / 2
    )
    union = inside.cummax(dim=1).values  # union of the first r blocks, (B, R, N)
    fits = union.sum(-1) <= k  # (B, R): a prefix of True
    last = fits.sum(1, keepdim=True)  # length of the longest fitting prefix
    chosen = union.gather(1, (last - 1).clamp_(min=0).unsqueeze(-1).expand(-1, 1, N)).squeeze(1) & (last > 0)
    keys = u[:, 1 + 4 * R :].masked_fill(chosen, 2.0)  # top up to exactly k with random patches
    return chosen | (_rank(keys) < k - chosen.sum(-1, keepdim=True))


_COORDS: dict[tuple[int, int, str], tuple[Tensor, Tensor]] = {}


def _grid_coords(H: int, W: int, device: torch.device | str) -> tuple[Tensor, Tensor]:
    """Row and column of every patch, (N,) float each (cached)."""
    key = (H, W, str(device))
    if key not in _COORDS:
        idx = torch.arange(H * W, device=device)
        _COORDS[key] = ((idx // W).float(), (idx % W).float())
    return _COORDS[key]


def _windowed(x: Tensor, window: int, fill: bool | float) -> Tensor:
    """(B, T) -> (B, nW, window), padding the tail with `fill`."""
    B, T = x.shape
    pad = (-T) % window
    if pad:
        x = torch.cat([x, x.new_full((B, pad), fill)], dim=1)
    return x.view(B, -1, window)


def select_windows(
    movable: Tensor, gamma: float, window: int | None, g: torch.Generator | None = None, least: int = 0
) -> Tensor:
    """(B, T) bool: per n-gram window of `window` slots, ~gamma of its movable slots (Eq. 6).

    ``least``: a sequence none of whose windows selects ``least`` slots has its largest window
    select min(least, its movable count) (a shuffle stays inside one window, so one selected
    slot in each of two windows would move nothing)."""
    if window is None or window >= movable.shape[1]:
        return select_random(movable, gamma, g, least)
    T = movable.shape[1]
    mov = _windowed(movable.bool(), window, False)  # (B, nW, window)
    n = mov.sum(-1).float()
    k = _counts(n, gamma, g)
    if least and gamma > 0:
        big = n.argmax(1, keepdim=True)  # the window with the most movable slots
        short = k.amax(1, keepdim=True) < least
        k.scatter_(
            1,
            big,
            torch.where(
                short, torch.maximum(k.gather(1, big), n.gather(1, big).clamp(max=least).long()), k.gather(1, big)
            ),
        )
    return _select(mov, k, g).flatten(1)[:, :T]


def jigsaw(selected: Tensor, window: int | None = None, g: torch.Generator | None = None) -> Tensor:
    """(B, N) long index map permuting the selected slots among themselves (per window if given).

    Random keys in [0, 1) on selected slots and ``2 + j`` elsewhere, argsorted, list the selected
    slots in random order followed by the rest in place; the same with keys ``j / N`` lists them
    in order. Scattering the first onto the second sends every selected slot to a random selected
    slot (of the same window) and leaves the others fixed. A row (window) of two or more selected
    slots whose draw is the identity gets a cyclic shift of its selected slots instead.
    """
    B, N = selected.shape
    if window is not None and window < N:
        W = window
        sel = _windowed(selected, W, False)  # (B, nW, W)
        local = jigsaw(sel.reshape(-1, W), None, g).view(B, -1, W)
        base = torch.arange(sel.shape[1], device=selected.device).view(1, -1, 1) * W
        return (local + base).flatten(1)[:, :N]
    j = torch.arange(N, device=selected.device).expand(B, N)
    rest = 2.0 + j.float()
    src = torch.where(selected, torch.rand(B, N, generator=g, device=selected.device), rest).argsort(dim=1)
    dst = torch.where(selected, j.float() / N, rest).argsort(dim=1)
    k = selected.sum(1, keepdim=True)
    still = (src == dst).all(1, keepdim=True) & (k >= 2)  # the draw moved nothing
    shift = torch.where(j < k, (j - 1) % k.clamp(min=1), j)  # selected slot i receives slot i - 1's token
    src = torch.where(still, dst.gather(1, shift), src)
    return torch.empty_like(j).scatter_(1, dst, src)


def apply_perm(tok: Tensor, perm: Tensor) -> Tensor:
    """Reorder (B, N, D) tokens: ``out[:, j] = tok[:, perm[:, j]]``.

    One row gather on the flattened batch: cheaper on CPU, forward and backward, than a `gather`
    with an index expanded over D.
    """
    B, N, D = tok.shape
    flat = (perm + torch.arange(0, B * N, N, device=perm.device).unsqueeze(1)).flatten()
    return tok.reshape(B * N, D).index_select(0, flat).view(B, N, D)
