"""The span attack's budget (`SpanAttack.budget`, issue 23): every search stops at it exactly (the
peeling walkers cut their scoring calls at what is left, `Walker.step(limit)`; the assignment
search and the decoder's extension likewise), and a budget that does not bind changes nothing."""

from __future__ import annotations

import pytest
import torch

from veil.attacks import Knowledge, create_attack, observe
from veil.data import load_data
from veil.models import create_model


@pytest.fixture(scope="module")
def scene():
    torch.manual_seed(0)
    sst2 = load_data("sst2", max_len=24, train_size=300, seed=0)
    model = create_model("transformer4", max_len=24, dim=96, depth=3)
    model.eval()
    return sst2, model


def _batch(data, B: int, max_real: int, seed: int = 1) -> dict[str, torch.Tensor]:
    mask = data.train["attention_mask"]
    ok = torch.nonzero(mask.sum(1) <= max_real).flatten()
    idx = ok[torch.randperm(len(ok), generator=torch.Generator().manual_seed(seed))[:B]]
    return {k: v[idx] for k, v in data.train.items()}


def _run(model, batch, know, **options):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rec = create_attack("span", **options).reconstruct(observe(model, batch), know)
    finally:
        torch.set_num_threads(before)
    return rec.token_ids, rec.stats


def test_peeling_stops_at_a_binding_budget_exactly(scene) -> None:
    """8 sentences of <= 24 tokens on width 96 (the case that scored 5,232 of 5,000 when the walkers
    checked between sweeps): every budget is spent to the sentence and said to have stopped it."""
    sst2, model = scene
    batch = _batch(sst2, 8, max_real=24)
    know = Knowledge(batch_size=8, seq_len=24, tokenizer=sst2.meta["tokenizer"])
    for budget in (5_000, 1_237):
        _, st = _run(model, batch, know, budget=budget)
        assert st["search"] == "peel" and st["sentences_scored"] == budget, st["work"]
        assert st["work"]["sentences_scored"] == budget and st["budget_stopped"] is True
        assert 0 < st["work"]["block_rows"] < st["budget"]["block_rows"] and st["budget_used"] == 1.0
        assert st["note"].startswith("stopped at budget (sentences_scored)")


def test_a_budget_that_does_not_bind_changes_nothing(scene) -> None:
    """A batch the peeling search solves: with the default budget, with a budget of exactly the work
    it needed (the same sentences, the same work), and one sentence short (stopped there)."""
    sst2, model = scene
    batch = _batch(sst2, 3, max_real=18)
    know = Knowledge(batch_size=3, seq_len=24, tokenizer=sst2.meta["tokenizer"])
    free, st = _run(model, batch, know)
    need = st["sentences_scored"]
    assert st["sentences_exact"] == 3 and not st["budget_stopped"] and need > 10
    same, st2 = _run(model, batch, know, budget=need)
    assert same == free and st2["sentences_scored"] == need and st2["sentences_exact"] == 3
    _, st3 = _run(model, batch, know, budget=need - 1)
    assert st3["sentences_scored"] == need - 1 and st3["budget_stopped"] is True and st3["sentences_exact"] < 3


def test_the_block_row_budget_stops_peeling_and_returns_its_best_guesses(scene) -> None:
    """The second unit (`veil.attacks.span.work`): a block-row budget below what the batch needs
    (per batch sentence) stops the search before the call that would pass it, says so, and still returns one sentence
    per batch member (the exact ones found, then the best guesses); one that does not bind changes
    nothing."""
    sst2, model = scene
    batch = _batch(sst2, 3, max_real=18)
    know = Knowledge(batch_size=3, seq_len=24, tokenizer=sst2.meta["tokenizer"])
    free, st = _run(model, batch, know)
    rows = st["work"]["block_rows"]
    assert st["sentences_exact"] == 3 and not st["budget_stopped"] and rows > 1000
    same, st2 = _run(model, batch, know, work=-(-rows // 3))  # `work` counts per batch sentence
    assert same == free and st2["work"] == st["work"] and not st2["budget_stopped"]
    assert st2["budget"]["block_rows"] - rows < 3
    cut, st3 = _run(model, batch, know, work=rows // 6)
    assert st3["budget_stopped"] is True and st3["work_stopped"] is True
    assert st3["work"]["block_rows"] <= rows // 2 and st3["sentences_exact"] < 3 and st3["budget_used"] <= 1.0
    assert st3["note"].startswith("stopped at budget (block_rows)")
    assert len(cut) == 3 and all(len(s) > 0 for s in cut)


@pytest.mark.parametrize("budget", [50, 177])
def test_assignment_and_decoder_searches_stop_exactly(scene, budget: int) -> None:
    """The encoder assignment search (peel=False) and the decoder's extension: a cut scoring call."""
    sst2, model = scene
    batch = _batch(sst2, 4, max_real=18)
    know = Knowledge(batch_size=4, seq_len=24, tokenizer=sst2.meta["tokenizer"])
    _, st = _run(model, batch, know, peel=False, budget=budget)
    assert st["search"] == "assignment" and st["sentences_scored"] == budget and st["budget_stopped"]
    torch.manual_seed(0)
    gpt = create_model("gpt-tiny", max_len=24)
    gpt.eval()
    _, st = _run(gpt, batch, know, budget=budget)
    assert st["prefixes_tested"] == budget and st["work"] == {"sentences_scored": budget}


def test_sentence_costs_are_scored_in_calls_sized_to_memory(scene, monkeypatch) -> None:
    """A sweep may score every vocabulary token at one position (layer 1 admits all once its span is
    full, e.g. under DP-SGD noise: one unchunked call held 12 GB): `sentence_costs` splits its
    sentences into calls of `rows_per_call`, with the same costs as one call."""
    from veil.attacks.span import core, search
    from veil.attacks.span.core import layer_span

    sst2, model = scene
    batch = _batch(sst2, 4, max_real=20)
    span2 = layer_span(observe(model, batch), 1)
    ids = batch["input_ids"].repeat(25, 1)  # 100 sentences
    mask = batch["attention_mask"].repeat(25, 1)
    whole = search.sentence_costs(model, span2, ids, mask)
    sizes: list[int] = []
    inner = search.layer_inputs
    monkeypatch.setattr(search, "layer_inputs", lambda m, i, k: sizes.append(len(i)) or inner(m, i, k))
    row = ids.shape[1] * span2.width * 2 * core.ACT_FLOATS * 4
    monkeypatch.setattr(core, "CALL_BYTES", 7 * row)
    split = search.sentence_costs(model, span2, ids, mask)
    assert sizes == [7] * 14 + [2]
    assert torch.equal(split, whole) and split.shape == (100, ids.shape[1])
    assert not split.requires_grad
