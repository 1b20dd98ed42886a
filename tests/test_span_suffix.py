"""The span attack's right-to-left seeds (`veil.attacks.span.suffix`): a sentence grown from its
[SEP] by the cost of the position after each token, one row of the MLP scored at a time
(`MLPScore.at`), and when a peeling search grows first."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from test_span_mlp import _minilm_span, _scene
from veil.attacks.span.checks import CLSCheck
from veil.attacks.span.mlp import MLPScore, mlp_spans
from veil.attacks.span.options import DEFAULTS
from veil.attacks.span.schedule import SCHEDULE, Member, Regime, regime
from veil.attacks.span.score import Objective, SentenceScore
from veil.attacks.span.suffix import SuffixGrowth, SuffixSeeder, reads_previous, suffix_seed
from veil.attacks.span.walker import Walker

CLS, SEP = 1, 2


class _PairScore:
    """A stand-in objective (no model) with the property the seeds rely on: position t costs 0 where
    its token follows the token before it as in `target`, else 1; the exact check passes `target`."""

    def __init__(self, target: list[int]) -> None:
        self.target = target
        self.pairs = set(zip(target, target[1:]))

    def __call__(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pc = torch.zeros(ids.shape)
        for i, row in enumerate(ids.tolist()):
            for t in range(1, len(row)):
                pc[i, t] = float((row[t - 1], row[t]) not in self.pairs)
        return pc, torch.full((len(ids),), float("inf"))

    def cls(self, ids: torch.Tensor) -> float:
        return 0.0 if ids[0].tolist() == self.target else 1.0


class _TripleScore(_PairScore):
    """Position t also costs 0.5 where the two tokens before it and its own are not three in a row
    of `target`: a token's cost reads its left context, as MiniLM's block-1 MLP input does. Where
    `decoy` may stand in for the token before t's as a pair, only the left context tells them apart."""

    def __init__(self, target: list[int], decoy: tuple[int, int, int]) -> None:
        super().__init__(target)
        self.pairs |= {(decoy[0], decoy[1]), (decoy[1], decoy[2])}
        self.triples = set(zip(target, target[1:], target[2:]))

    def __call__(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pc, dc = super().__call__(ids)
        for i, row in enumerate(ids.tolist()):
            for t in range(2, len(row)):
                pc[i, t] += 0.5 * float((row[t - 2], row[t - 1], row[t]) not in self.triples)
        return pc, dc


class _Stage:
    def __init__(self, target: list[int], lengths: list[int], width: int = 12) -> None:
        tokens = torch.arange(10, 10 + width)
        T = max(lengths)
        self.cands = [torch.tensor([CLS]), *[torch.cat([tokens, torch.tensor([SEP])])] * (T - 1)]
        self.prior = type("NoPrior", (), {"best": staticmethod(lambda t, c: None)})()
        self.score = _PairScore(target)
        rng = np.random.default_rng(0)
        self.walkers = [Walker([torch.tensor([CLS]), *[tokens] * (n - 2), torch.tensor([SEP])], rng) for n in lengths]
        self.grower = None  # what counts this stage's scored sentences (a seeder or the growth member)
        self.objective, self.tol, self.opts = Objective.MLP, 1e-4, DEFAULTS

    @property
    def lengths(self) -> list[int]:
        return [w.n for w in self.walkers]

    @property
    def scored(self) -> int:
        return self.grower.steps if self.grower is not None else 0


class _Specials:
    cls, sep, pad = CLS, SEP, 0


def test_a_sentence_is_grown_from_its_end_and_the_other_lengths_restart_their_walkers() -> None:
    """The target's first token is its own successor's only predecessor, so growing from [SEP] picks
    it at every position; the 5-token length is exact, the others restart their walks from their
    grown sentence; every candidate of every position scored is counted."""
    target = [CLS, 13, 17, 11, SEP]
    stage = _Stage(target, [4, 5, 6])
    before = stage.walkers[1].x.clone()
    seeder = stage.grower = SuffixSeeder(stage, _Specials(), tol_cls=1e-4)
    out = suffix_seed(stage, seeder, budget=10_000)
    assert out.hits == [target] and [n for n, _ in out.restarts] == [4, 6]
    for n, content in out.restarts:  # what the stage's search loop does with a proposal's restarts
        next(w for w in stage.walkers if w.n == n).restart(content)
    # 12 content candidates at each grown position, then the next sweep at the positions a change
    # left within reach: length 4 re-scores position 2 (its left neighbour changed after it), length
    # 6 positions 4 and 3; the exact length 5 stops after its first sweep
    assert stage.grower.steps == 12 * (2 + 3 + 4) + 12 * (1 + 2)
    four, _, six = stage.walkers
    assert four.cur is None and four.x[0, -1] == SEP and four.x[0, 1:3].tolist() == [17, 11]  # restarted
    assert six.cur is None and six.x[0, 3:5].tolist() == [17, 11]
    assert torch.equal(stage.walkers[1].x, before)  # the exact length's walk is left alone


def test_a_wrong_step_of_the_growth_is_repaired_by_the_next_sweep() -> None:
    """Growing [CLS] 13 17 11 15 [SEP] from its end: 12 and 17 both precede 11 as pairs, and with the
    prior's filler left of them (10) neither is three in a row, so the first sweep takes 12 (the
    first of the tie) and then 13 before it, which is a pair with 12 too: a chimera. The next sweep
    reads 13 as the left context and takes 17: the target, exact, so the growth stops there."""
    target = [CLS, 13, 17, 11, 15, SEP]
    stage = _Stage(target, [6])
    stage.score = _TripleScore(target, decoy=(13, 12, 11))
    seeder = SuffixSeeder(stage, _Specials(), tol_cls=1e-4)
    stage.grower = seeder
    assert seeder.grow(6, budget=10_000, sweeps=1) == [CLS, 13, 12, 11, 15, SEP]
    once = seeder.steps
    assert once == 12 * 4
    assert seeder.grow(6, budget=10_000) == target
    # the second growth: 4 positions, then 4, 3 and 2 again (each changed near them after they were
    # scored) and 1 (17 replaced 12 beside it); it stops there, exact
    assert seeder.steps - once == 12 * 4 + 12 * 4


class _RuleScore(_PairScore):
    """Position t costs `rule(row, t)`: a stand-in whose dependence on other tokens is chosen."""

    def __init__(self, rule) -> None:
        super().__init__([CLS, SEP])
        self.rule = rule

    def __call__(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pc = torch.tensor([[float(self.rule(row, t)) for t in range(len(row))] for row in ids.tolist()])
        return pc, torch.full((len(ids),), float("inf"))


def test_repairs_run_only_where_a_position_reads_the_token_before_it() -> None:
    """`reads_previous` holds where a position's cost follows the token before it (as MiniLM's block 1),
    not where it follows the whole sentence alike (no first-layer head reads the previous token);
    a search's growth then sweeps once only."""
    stage = _Stage([CLS, 13, 17, 11, SEP], [12])
    previous = _RuleScore(lambda row, t: (row[t - 1] * 7 + row[t]) % 5 / 5 if t else 0.0)
    whole = _RuleScore(lambda row, t: sum(row) % 7 / 7)
    for score, reads in ((previous, True), (whole, False)):
        stage.score = score
        seeder = SuffixSeeder(stage, _Specials())
        stage.grower = seeder
        assert reads_previous(seeder, 12) is reads
        assert seeder.steps == 2 * 7 * 5  # two offsets at positions 4, 5, .., 10, the first 5 candidates each
    growth = stage.grower = SuffixGrowth(_Specials(), on=True)
    growth.propose(stage, budget=10_000)
    assert growth.reads_previous is False and growth.steps == 70 + 12 * 10  # one sweep of 10 positions


def test_the_growth_stops_at_the_budget() -> None:
    stage = _Stage([CLS, 13, 17, 11, SEP], [5, 6])
    seeder = SuffixSeeder(stage, _Specials())
    stage.grower = seeder
    assert seeder.grow(5, budget=30) is None and seeder.steps == 24  # the third position would pass 30
    assert seeder.grow(5, budget=10_000) == [CLS, 13, 17, 11, SEP]


def test_a_search_grows_first_near_the_rank_limit_and_once_it_has_met_the_graded_objective() -> None:
    """The schedule (`veil.attacks.span.schedule`): on an exact MLP objective well below its rank
    limit the prefix seeds run before the growth, within `suffix_near` of it the growth first; once
    a search has met the graded objective (where the growth runs first) it grows first on every
    MLP stage, never first on layer 2; a growth that is off proposes nothing."""

    def growth_first(r: Regime) -> bool:
        before = SCHEDULE[r].before
        return Member.SUFFIX in before and (
            Member.PREFIX not in before or before.index(Member.SUFFIX) < before.index(Member.PREFIX)
        )

    near = DEFAULTS.suffix_near
    assert regime(Objective.MLP, False, near <= 315 / 383) == Regime.MLP and not growth_first(Regime.MLP)
    assert Member.SUFFIX in SCHEDULE[Regime.MLP].before  # then, after prefix seeds that found none
    assert regime(Objective.MLP, False, near <= 341 / 383) == Regime.MLP_NEAR and growth_first(Regime.MLP_NEAR)
    stage = _Stage([CLS, 13, 17, 11, SEP], [5])
    g = stage.grower = SuffixGrowth(_Specials(), on=True)
    g.propose(stage, budget=10_000)
    assert not g.past  # an exact MLP stage does not mark the search
    stage.objective = Objective.MLP_GRADED
    g.propose(stage, budget=10_000)
    assert g.past and regime(Objective.MLP, False, g.past) == Regime.MLP_NEAR and growth_first(Regime.MLP_GRADED)
    assert regime(Objective.LAYER2, False, g.past) == Regime.LAYER2 and not growth_first(Regime.LAYER2)
    off = stage.grower = SuffixGrowth(_Specials(), on=False)
    out = off.propose(stage, budget=10_000)
    assert not out.hits and not out.restarts and off.steps == 0 and off.hits is None


def _one_column_varied():
    """Two sentences' client step on a small encoder, and six copies of the first with column 3 varied."""
    model, res, sents, _ = _scene(2, 1)
    s = sents[0]
    x = torch.tensor([s] * 6)
    x[1:, 3] = torch.tensor(s[4:9])
    return model, res, CLSCheck(res), s, x


def test_mlp_score_at_one_position_equals_the_full_scores_column() -> None:
    """`MLPScore.at` feeds block 1's MLP only row t and shares the Q/K/V rows of the columns where
    the sentences agree: the same cost as `_scores`' column t (float32), with one column varied or
    two; with two blocks' spans (the narrowed MLP would change block 2's input) it falls back."""
    model, res, check, s, x = _one_column_varied()
    with torch.no_grad():
        for blocks in (1, 2):
            score = MLPScore(model, mlp_spans(res, blocks), res.layer_span(1, 1e-6), check)
            full = score(x)[0]
            for t in (1, 4, len(s) - 1):
                assert torch.allclose(score.at(x, t), full[:, t], atol=1e-5), (blocks, t)
            assert score._rowwise is (True if blocks == 1 else None)
            assert score.rows_shared is (True if blocks == 1 else None)  # block 1's shared rows were used
    y = x.clone()
    y[2:, 6] = torch.tensor(s[1:5])  # two columns differ: both go through Q/K/V per sentence
    score = MLPScore(model, mlp_spans(res, 1), res.layer_span(1, 1e-6), check)
    with torch.no_grad():
        full = score(y)[0]
        for t in (3, 6, 7):
            assert torch.allclose(score.at(y, t), full[:, t], atol=1e-5), t


def test_layer_2_score_at_one_position_equals_the_full_scores_column() -> None:
    """`SentenceScore.at` (the uncrowded layer-2 objective) computes block 1 for row t only: the same
    cost as the full pass's column t; with the [CLS] distance in the objective, the full column."""
    model, res, check, s, x = _one_column_varied()
    with torch.no_grad():
        score = SentenceScore(model, res.layer_span(1, 1e-6), check, with_cls=False)
        full = score(x)[0]
        for t in (2, 4, len(s) - 1):
            assert torch.allclose(score.at(x, t), full[:, t], atol=1e-4), t
        assert score.row_ok is True
        crowded = SentenceScore(model, res.layer_span(1, 1e-6), check, with_cls=True)
        assert torch.equal(crowded.at(x, 4), crowded(x)[0][:, 4]) and crowded.row_ok is None


@pytest.mark.slow
def test_span_rebuilds_a_minilm_batch_of_16_past_the_mlp_rank_limit() -> None:
    """MiniLM, 16 SST-2 test sentences (420 tokens): the layer-2 span is full and the MLP spans at
    their rank limit (graded); the right-to-left seeds, then the prefix seeds and walkers on the
    residuals, rebuild all 16 sentences exactly: 388,807 scored here, at any thread count (the
    repair sweeps score more sentences than the single growth, 273,817, each one row of block 1
    through `MLPScore.at`: 50 s instead of 88 s at 2 threads; the budget was 300,000 before them).
    Before span.suffix: 3 of 16 in 500,000."""
    batch, rec = _minilm_span(16, budget=400_000)
    assert rec.stats["stages"][0]["objective"] == "mlp-graded" and rec.stats["stages"][0]["suffix_hits"] >= 1
    assert rec.stats["sentences_exact"] == 16, rec.stats["work"]
    truth = sorted(ids[m.bool()].tolist() for ids, m in zip(batch["input_ids"], batch["attention_mask"]))
    assert sorted(rec.token_ids) == truth
