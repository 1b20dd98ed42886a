"""span-down: the pool-free span attack on the MLP down-projections (`veil.attacks.span.down`).
AEGIS as published exports them in the clear; veil's default noises them (eq. M)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from veil.attacks import create_attack
from veil.attacks.harness import attack_once
from veil.defenses import create_defense
from veil.models import create_model

VOCAB = 300
TOK = SimpleNamespace(vocab_size=VOCAB, cls_id=101, sep_id=102, pad_id=0)


def _data(batch: dict[str, torch.Tensor]) -> SimpleNamespace:
    return SimpleNamespace(meta={"tokenizer": TOK, "special_ids": [0, 101, 102]}, test=batch)


def _batch(n: int, T: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(103, VOCAB, (n, T), generator=g)
    ids[:, 0], ids[:, -1] = 101, 102
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.arange(n) % 2}


def _model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return create_model(name, vocab_size=VOCAB, dim=32, depth=2, heads=2)


def _run(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], attack: dict | None = None, **aegis: float
) -> tuple[list[list[int]], dict]:
    d = create_defense("aegis", **aegis).attach(model)
    try:
        att = create_attack("span-down", **(attack or {}))
        rec, _, _ = attack_once(att, model, batch, [d], _data(batch), "original", 0)
    finally:
        d.detach()
    return rec.token_ids or [], rec.stats


def test_encoder_sentence_rebuilt_from_the_clean_down_projection_and_lost_under_the_default() -> None:
    model, batch = _model("transformer4"), _batch(1, 10)
    truth = batch["input_ids"][0].tolist()
    got, stats = _run(model, batch, {"sweeps": 2}, mlp_down_noise=0.0)  # AEGIS as published on an encoder
    assert got == [truth] and not stats["noised"] and stats["lengths"] == [10]
    got, stats = _run(model, batch, {"sweeps": 2})  # veil's default: eq. (M) on the down-projection too
    assert stats["noised"] and sum(a == b for a, b in zip(got[0][1:-1], truth[1:-1])) <= 2


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
def test_decoder_batch_rebuilt_with_its_last_tokens_from_the_clean_head(name: str) -> None:
    model, batch = _model(name), _batch(2, 8)
    batch["input_ids"][1, -1] = 150  # a last token that is not [SEP]: read off the head, not guessed
    got, stats = _run(model, batch, {"head_candidates": 32}, head_noise=0.0, mlp_down_noise=0.0)
    assert sorted(got) == sorted(batch["input_ids"].tolist()) and stats["head_clean"]
    assert stats["candidates"] == 32  # the head's largest rows (its targets among them), not the vocabulary


def test_reads_every_down_projection_the_position_table_and_the_lm_head() -> None:
    model = _model("gpt-tiny")
    reads = create_attack("span-down").reads(model)
    assert {"blocks.0.mlp.fc2.weight", "blocks.1.mlp.fc2.weight", "pos.weight", "lm_head.weight"} <= set(reads)


def test_a_repeated_first_token_passes_the_span_test_but_has_rank_one() -> None:
    """RoPE: a run of one token gives every position the same activation (in the span whenever
    the first is), so the decoder search ranks found prefixes by their activations' rank first."""
    from veil.attacks.span.down import down_modules
    from veil.attacks.span.down_search import activation_rank

    model = _model("llama-tiny")
    down = down_modules(model)[0]
    assert activation_rank(model, down, [101] * 6) == 1
    assert activation_rank(model, down, _batch(1, 6)["input_ids"][0].tolist()) == 6


@pytest.mark.parametrize(("name", "fast"), [("transformer4", "embed"), ("llama-tiny", "shared")])
def test_row_scoring_agrees_with_the_full_pass_and_takes_the_fast_path_where_it_holds(name: str, fast: str) -> None:
    """Each candidate is scored at its own row (`down_rows`): the distances match the full forward
    pass's, an absolute-position encoder takes the one-row path, RoPE falls back to shared rows."""
    from veil.attacks.span.checks import row_span
    from veil.attacks.span.down import down_modules
    from veil.attacks.span.down_rows import row_activation
    from veil.attacks.span.down_search import RowScorer

    model, batch = _model(name), _batch(3, 8)
    model.eval()
    down = down_modules(model)[0]
    span = row_span(torch.randn(16, down.weight.shape[1], generator=torch.Generator().manual_seed(1)).double(), k=None)
    scorer = RowScorer(model, down, span, limit=10**6)
    t = 7 if model.causal else 3  # a prefix search scores its last column
    cand = batch["input_ids"][:1].expand(VOCAB, -1).clone()
    cand[:, t] = torch.arange(VOCAB)
    got = scorer(cand, t)
    plain = row_activation(model, cand, t, down, "plain")[:, 0]
    want = (1 - ((plain @ scorer.basis).pow(2).sum(-1) / plain.pow(2).sum(-1))).clamp_min(0).sqrt()
    assert scorer.mode == fast and torch.allclose(got, want, atol=1e-4)
