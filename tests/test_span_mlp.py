"""The MLP down-projection objective of the span attack's peeling (`veil.attacks.span.mlp`): where
the layer-2 span is full it still ranks a batch sentence below its variants with wrong tokens,
and where the MLP span is below its rank limit it is an exact per-position test."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from veil.attacks import Knowledge, create_attack
from veil.attacks.base import observe
from veil.attacks.harness import knowledge_for, private_batches
from veil.attacks.span.checks import CLSCheck
from veil.attacks.span.mlp import MLPScore, mlp_exact, mlp_spans, mlp_usable
from veil.attacks.span.residual import Residual
from veil.build import build_run
from veil.config import load_config
from veil.data import load_data
from veil.models import create_model


def _scene(long: int, short: int):
    torch.manual_seed(0)
    model = create_model("transformer4", max_len=24, dim=96, depth=3)
    model.eval()
    data = load_data("sst2", max_len=24, train_size=300, seed=0)
    real = data.train["attention_mask"].sum(1)
    idx = torch.cat([torch.nonzero(real >= 22).flatten()[:long], torch.nonzero(real <= 10).flatten()[:short]])
    batch = {k: v[idx] for k, v in data.train.items()}
    sents = [ids[m.bool()].tolist() for ids, m in zip(batch["input_ids"], batch["attention_mask"])]
    res = Residual(observe(model, batch), len(idx))
    return model, res, sents, Knowledge(batch_size=len(idx), seq_len=24, tokenizer=data.meta["tokenizer"])


def _variants(sent: list[int], bag: list[int], k: int, rng: random.Random) -> list[int]:
    x = list(sent)
    for t in rng.sample(range(1, len(x) - 1), k):  # [CLS] and [SEP] stay
        x[t] = rng.choice([v for v in bag if v != x[t]])
    return x


def _costs(score: MLPScore, sents: list[list[int]], ks: tuple[int, ...]) -> dict[int, list[float]]:
    rng = random.Random(0)
    bag = sorted({v for s in sents for v in s[1:-1]})
    out: dict[int, list[float]] = {k: [] for k in ks}
    for s in sents:
        for k in ks:
            x = torch.tensor([_variants(s, bag, k, rng)])
            out[k].append(float(score(x)[0].mean()))
    return out


def test_mlp_cost_ranks_the_true_sentence_below_wrong_ones_where_the_layer_2_span_is_full() -> None:
    """Four 22-24-token sentences and a short one (101 tokens, width 96): the layer-2 span is the
    whole space (95 of 96: a LayerNorm's centred outputs; its distance is 0 for any sentence), the MLP-down spans keep 96 of 384 hidden
    directions (graded); every sentence costs less than itself with 1 wrong token, and that less
    than with 4 wrong, per sentence."""
    model, res, sents, _ = _scene(4, 1)
    assert sum(len(s) for s in sents) > 96
    span2 = res.layer_span(1, 1e-6)
    assert span2.rank >= span2.width - 1  # full (a LayerNorm's centred outputs): layer 2 tells nothing here
    spans = mlp_spans(res, 1)
    assert mlp_usable(spans) and not mlp_exact(spans)
    score = MLPScore(model, spans, span2, CLSCheck(res))
    with torch.no_grad():
        c = _costs(score, sents, (0, 1, 4))
    assert all(a < b < d for a, b, d in zip(c[0], c[1], c[4])), c


def test_mlp_cost_is_exact_below_the_rank_limit() -> None:
    """Three short sentences (< 96 tokens): the MLP span is span{a_i} itself, so the true
    sentence's positions lie on it (float32 rounding) and one wrong token moves the mean cost
    by orders of magnitude more."""
    model, res, sents, _ = _scene(0, 3)
    assert sum(len(s) for s in sents) < 96
    spans = mlp_spans(res, 1)
    assert mlp_exact(spans)
    score = MLPScore(model, spans, res.layer_span(1, 1e-6), CLSCheck(res))
    with torch.no_grad():
        c = _costs(score, sents, (0, 1))
        worst_true = max(float(score(torch.tensor([s]))[0].max()) for s in sents)
    assert worst_true < 2e-3, worst_true
    assert min(c[1]) > 10 * max(c[0]), c


def test_mlp_scores_in_one_call_or_in_chunks_alike_and_the_cls_distance_on_demand() -> None:
    model, res, sents, _ = _scene(2, 1)
    spans = mlp_spans(res, 2)
    check = CLSCheck(res)
    score = MLPScore(model, spans, res.layer_span(1, 1e-6), check)
    s = sents[0]
    x = torch.tensor([s] * 5)
    x[1:, 2] = torch.tensor([s[3], s[4], s[5], s[6]])
    with torch.no_grad():
        pc, dc = score(x)
        pc2 = torch.cat([score(x[i : i + 2])[0] for i in range(0, 5, 2)])
        assert torch.allclose(pc, pc2, atol=1e-5)
        assert pc.shape == x.shape and torch.isinf(dc).all()  # no [CLS] distance unless asked
        assert score.cls(x[:1]) < 1e-4 < score.cls(x[1:2])  # the exact check still tells the true sentence
        full = MLPScore(model, spans, res.layer_span(1, 1e-6), check, with_cls=True)(x)
    assert torch.allclose(full[0], pc, atol=1e-5) and float(full[1][0]) < 1e-4


def _minilm_span(batch_size: int, budget: int) -> tuple[dict, Any]:
    """The span attack on one client step of MiniLM ([CLS] pooling, dropout 0) over `batch_size`
    SST-2 test sentences of up to 32 tokens, one thread."""
    torch.set_num_threads(1)
    over = ["model=minilm", "model.dropout=0", "model.pooling=cls", "data=sst2", "data.tokenizer=wordpiece"]
    model, data, defenses = build_run(load_config(None, [*over, "data.max_len=32", "data.train_size=64"]))
    batch = private_batches(data.test, batch_size, 1, seed=0)[0]
    model.eval()
    know = knowledge_for(batch, data, defenses, 0, None)
    return batch, create_attack("span", budget=budget).reconstruct(observe(model, batch, defenses), know)


@pytest.mark.slow
def test_span_peels_a_minilm_batch_16_sentence_where_the_layer_2_span_is_full() -> None:
    """MiniLM ([CLS] pooling, dropout 0), 16 SST-2 test sentences (420 tokens): the layer-2 span is
    full (384 of 384) and the MLP-down spans are at their rank limit (383), so peeling's first
    stage searches the graded MLP objective; it finds an exact sentence (the [CLS] check) within
    20,000 sentences scored. Before span.mlp: none in 100,000 (docs/results.md, span-scale)."""
    batch, rec = _minilm_span(16, budget=20_000)
    first = rec.stats["stages"][0]
    assert first["rank2"] == 384 and first["objective"] == "mlp-graded", first
    assert rec.stats["sentences_exact"] >= 1, rec.stats["work"]
    truth = [ids[m.bool()].tolist() for ids, m in zip(batch["input_ids"], batch["attention_mask"])]
    assert rec.token_ids[0] in truth


@pytest.mark.slow
def test_span_rebuilds_a_minilm_batch_of_12_on_the_mlp_objective() -> None:
    """MiniLM, 12 SST-2 test sentences (315 tokens): layer 2's span leaves 69 of 384 directions, the
    MLP spans are exact (315 of 384 in 1536); the prefix seeds over every candidate on the MLP
    objective rebuild all 12 sentences (55,728 scored here). Before span.mlp: token 0.182, 100,000
    spent; with the MLP objective but the prior's 24 likeliest tokens: 4 exact, 100,000 spent."""
    _, rec = _minilm_span(12, budget=100_000)
    assert rec.stats["stages"][0]["objective"] == "mlp", rec.stats["stages"][0]
    assert rec.stats["sentences_exact"] == 12 and not rec.stats["budget_stopped"], rec.stats["work"]
