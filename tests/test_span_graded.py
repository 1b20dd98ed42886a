"""The peeling search on a graded objective (`veil.attacks.span.peel`): a walk's new lowest best
restarts its neighbouring lengths from its content and puts them first; the MLP test counts as
exact below width - 1; the prefix seeds grow one first token per turn, each once per stage."""

from __future__ import annotations

import numpy as np
import torch

from veil.attacks.span.mlp import mlp_exact
from veil.attacks.span.options import DEFAULTS, SpanOptions
from veil.attacks.span.prefix import PrefixSeeds
from veil.attacks.span.walker import Walker
from veil.attacks.span.walks import _lowest, extend_seed


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
    extend_seed(w, ws, used, DEFAULTS.extend_lengths)
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


class _Score:
    """A stand-in objective (no model): a position costs 0 where it holds `target`'s token, else 1;
    the exact check passes `target` alone."""

    def __init__(self, target: list[int]) -> None:
        self.target = torch.tensor(target)

    def __call__(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = min(ids.shape[1], len(self.target))
        pc = torch.ones(ids.shape)
        pc[:, :n] = (ids[:, :n] != self.target[:n]).float()
        return pc, torch.full((len(ids),), float("inf"))

    def cls(self, ids: torch.Tensor) -> float:
        return 0.0 if ids.shape[1] == len(self.target) and bool((ids[0] == self.target).all()) else 1.0


class _Stage:
    """A stand-in stage view: `starts` first tokens grown per stage (none left to peel but this)."""

    def __init__(self, target: list[int], width: int, starts: int, seeds: PrefixSeeds) -> None:
        tokens = torch.arange(10, 10 + width)
        self.cands = [torch.tensor([1]), *[tokens] * (len(target) + 1)]
        self.prior = type("NoPrior", (), {"cost": None})()
        self.score, self.objective, self.lengths = _Score(target), "mlp-graded", []
        self.left, self.tol, self.gate, self.opts = 0, 1e-4, float("inf"), SpanOptions(prefix_starts=starts)
        self.seeds = seeds

    @property
    def scored(self) -> int:
        return self.seeds.steps


def test_one_turn_of_prefix_seeds_grows_one_first_token_each_once() -> None:
    """A turn grows from the next first token not grown on this stage, in the prior's order (here
    the vocabulary's), and `left` counts those still to grow; once none is left a turn grows
    nothing. Where a sentence passes the exact check, the turn returns it."""
    specials = type("Specials", (), {"cls": 1, "sep": 2, "pad": 0})()
    seeds = PrefixSeeds(specials, on=True)
    stage = _Stage([1, 12, 15, 11, 2], width=3, starts=3, seeds=seeds)
    stage.score.cls = lambda ids: 1.0  # nothing passes: the turns' bookkeeping alone
    seeds.begin(stage)
    steps = []
    for done, left in (({10}, 2), ({10, 11}, 1), ({10, 11, 12}, 0), ({10, 11, 12}, 0)):
        assert seeds.turn(stage, 10**6).hits == []
        assert seeds.seeder.done == done and seeds.seeder.left == left and seeds.more == (left > 0)
        steps.append(seeds.seeder.steps)
    assert steps[0] > 0 and steps[1] > steps[0] and steps[2] > steps[1] and steps[3] == steps[2]
    assert seeds.fresh == {10: 1, 11: 1, 12: 1} and seeds.grown == {}  # a turn's first tokens: this stage's
    target = [1, 12, 15, 11, 2]
    other = PrefixSeeds(specials, on=True)
    found = _Stage(target, width=6, starts=6, seeds=other)
    other.begin(found)
    assert other.turn(found, 10**6).hits == [target]
