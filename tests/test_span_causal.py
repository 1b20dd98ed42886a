"""The decoder search's one-row scorer (`veil.attacks.span.causal`): the last position's layer-2
span distance computed through block 1 for that row alone gives the full forward pass's scores and
ranking, and the decoder search recovers the same sentences with it as with the full pass."""

from __future__ import annotations

import pytest
import torch

from veil.attacks import Knowledge, create_attack, observe
from veil.attacks.span import causal
from veil.attacks.span.core import layer_span
from veil.attacks.span.search import sentence_costs
from veil.data import load_data
from veil.models import create_model

DECODERS = [("gpt-tiny", {"dim": 96, "depth": 3}), ("hf-gpt2", {"dim": 128, "depth": 2, "dropout": 0.0})]


@pytest.fixture(scope="module")
def sst2():
    return load_data("sst2", max_len=24, train_size=300, seed=0)


def _batch(data, B: int, max_real: int = 16) -> dict[str, torch.Tensor]:
    mask = data.train["attention_mask"]
    ok = torch.nonzero(mask.sum(1) <= max_real).flatten()
    idx = ok[torch.randperm(len(ok), generator=torch.Generator().manual_seed(1))[:B]]
    return {k: v[idx] for k, v in data.train.items()}


def _model(name: str, kw: dict):
    torch.manual_seed(0)
    model = create_model(name, max_len=24, **kw)
    model.eval()
    return model


def _prefixes(batch, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """True prefixes of length t, the same with a token swapped, random ones; the batch's tokens at t."""
    true = batch["input_ids"][:, :t]
    swapped = true.clone()
    swapped[:, -1] = true[:, -1].roll(1)
    noise = torch.randint(1000, 5000, (4, t), generator=torch.Generator().manual_seed(0))
    toks = torch.cat([batch["input_ids"][:, t], torch.tensor([1996, 2023])]).unique()
    return torch.cat([true, swapped, noise]), toks


def _full(model, span2, prefixes, toks) -> torch.Tensor:
    ids = causal.extended(prefixes, toks)
    return sentence_costs(model, span2, ids, torch.ones_like(ids))[:, -1]


@pytest.mark.parametrize("name,kw", DECODERS)
def test_last_row_scores_and_ranking_match_the_full_pass(sst2, name, kw) -> None:
    """True extensions (distance at float32 rounding) and wrong ones: each fast way gives the full
    forward pass's distances up to rounding, the same pass/fail at the tolerance and the same order
    among the wrong ones; the scorer keeps the direct one-row block (its first-step check passed)."""
    model = _model(name, kw)
    batch = _batch(sst2, 4)
    span2 = layer_span(observe(model, batch), 1)
    prefixes, toks = _prefixes(batch, 7)
    full = _full(model, span2, prefixes, toks)
    score = causal.LastRowScorer(model, span2)
    got = score(prefixes, toks, len(prefixes) * len(toks))
    assert score.way is causal.block_rows
    hooks = span2.distance(causal.last_rows(model, prefixes, toks)).float()
    for fast in (got, hooks):
        assert torch.allclose(fast, full, rtol=1e-3, atol=1e-5), (fast, full)
        assert torch.equal(fast < 1e-3, full < 1e-3)
        wrong = torch.nonzero(full > 1e-3).flatten()
        assert len(wrong) > len(full) // 2 and torch.equal(fast[wrong].argsort(), full[wrong].argsort())
    assert int((got < 1e-4).sum()) >= 4  # each true prefix with its own next token
    cut = score(prefixes, toks, 5)  # the budget's cut: the first n extensions
    assert len(cut) == 5 and torch.allclose(cut, got[:5], rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("name,kw", DECODERS)
def test_decoder_search_recovers_the_same_with_the_full_pass(sst2, name, kw, monkeypatch) -> None:
    """The whole attack (decoder search) with the one-row scorer and with the full forward pass
    forced: the same sentences (true ones tie at float32 rounding, so their order may differ), the
    same prefixes scored, and the batch rebuilt exactly."""
    model = _model(name, kw)
    batch = _batch(sst2, 3, max_real=12)
    know = Knowledge(batch_size=3, seq_len=24, tokenizer=sst2.meta["tokenizer"])
    fast = create_attack("span").reconstruct(observe(model, batch), know)
    monkeypatch.setattr(causal.LastRowScorer, "way", property(lambda self: causal.full_rows))
    full = create_attack("span").reconstruct(observe(model, batch), know)
    assert sorted(fast.token_ids) == sorted(full.token_ids)
    assert fast.stats["prefixes_tested"] == full.stats["prefixes_tested"]
    refs = [ids[m.bool()].tolist() for ids, m in zip(batch["input_ids"], batch["attention_mask"])]
    assert sorted(fast.token_ids) == sorted(refs)


def test_a_span_that_reads_whole_sentences_gets_the_full_pass(sst2) -> None:
    """A span whose test compares a position with the one before it (`AdapterSpan.distinct`) is
    scored by the full forward pass of every row."""
    model = _model(*DECODERS[0])
    span2 = layer_span(observe(model, _batch(sst2, 2)), 1)
    span2.distinct = True  # type: ignore[attr-defined]
    assert causal.LastRowScorer(model, span2).way is causal.full_rows


def test_a_block_the_fast_ways_do_not_fit_falls_back(sst2, monkeypatch) -> None:
    """Where a fast way disagrees with the full pass (a block built differently), the first step
    with a prefix notices and the next way that agrees scores from then on: the hooks, else the
    full pass, with the full pass's distances."""
    model = _model(*DECODERS[0])
    batch = _batch(sst2, 2)
    span2 = layer_span(observe(model, batch), 1)
    prefixes, toks = _prefixes(batch, 5)
    wrong = lambda m, p, k: causal.full_rows(m, p, k)[:, -1] * 1.01 + 0.1  # noqa: E731
    monkeypatch.setattr(causal, "block_rows", wrong)
    score = causal.LastRowScorer(model, span2)
    score(prefixes, toks, 3)
    assert score.way is causal.last_rows
    monkeypatch.setattr(causal, "last_rows", wrong)
    score = causal.LastRowScorer(model, span2)
    got = score(prefixes, toks, len(prefixes) * len(toks))
    assert score.way is causal.full_rows
    assert torch.allclose(got, _full(model, span2, prefixes, toks), rtol=1e-5, atol=1e-7)
