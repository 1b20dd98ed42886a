"""The peeling search on a graded objective (`veil.attacks.span.peel`): a walk's new lowest best
restarts its neighbouring lengths from its content and puts them first; a restarted walk scores
its new sentence afresh; the prefix seeds grow one first token per turn, each once per stage."""

from __future__ import annotations

import numpy as np
import torch

from veil.attacks.span.mlp import mlp_exact
from veil.attacks.span.peel import _lowest, extend_seed
from veil.attacks.span.walker import Walker


def _walkers(lengths: list[int]) -> list[Walker]:
    rng = np.random.default_rng(0)
    return [Walker([torch.tensor([1]), *[torch.arange(10, 20)] * (n - 2), torch.tensor([2])], rng) for n in lengths]


def test_a_new_lowest_best_restarts_the_neighbouring_lengths_first() -> None:
    ws = _walkers([5, 6, 7, 8, 9])
    w = ws[1]  # length 6: content 11 12 13 14
    w.best = (0.06, 1.0, torch.tensor([[1, 11, 12, 13, 14, 2]]))
    ws[3].best = (0.8, 1.0, torch.tensor([[1, 19, 19, 19, 19, 19, 19, 2]]))
    assert _lowest(w, ws) and not _lowest(ws[3], ws)
    for v in ws:
        v.cur = (1.0, 1.0)  # mid-walk
    used = [5.0, 9.0, 7.0, 8.0, 6.0]
    extend_seed(w, ws, used)
    # lengths 5, 7 and 8 restart from the content (8 keeps its own best token at its last free position)
    assert ws[0].x[0].tolist() == [1, 11, 12, 13, 2]
    assert ws[2].x[0].tolist()[:5] == [1, 11, 12, 13, 14]
    assert ws[3].x[0].tolist() == [1, 11, 12, 13, 14, 19, 19, 2]
    assert all(v.cur is None for v in (ws[0], ws[2], ws[3])) and ws[4].cur is not None and w.cur is not None
    assert used == [5.0, 9.0, 5.0, 5.0, 6.0]  # the restarted walks run next (the least work), the others keep theirs


def test_the_mlp_test_is_exact_below_width_minus_one() -> None:
    class Down:
        out_features = 384

    class Sp:
        def __init__(self, rank: int) -> None:
            self.rank, self.width = rank, 1536

    assert mlp_exact([(Down(), Sp(367))]) and mlp_exact([(Down(), Sp(382))])
    assert not mlp_exact([(Down(), Sp(383))]) and not mlp_exact([])  # a post-LN block's full span: 383 of 384
