"""span-robust: the span attack when the client trains with dropout (issue 16)."""

from __future__ import annotations

import pytest
import torch

from veil.attacks import Knowledge, create_attack, list_attacks
from veil.attacks.base import observe
from veil.attacks.span.robust import max_dropped, robust_residuals
from veil.data import load_data
from veil.errors import VeilError
from veil.metrics import text_report
from veil.models import create_model

SPECIAL = {0, 101, 102}


@pytest.fixture(scope="module")
def sst2():
    return load_data("sst2", max_len=24, train_size=300, seed=0)


def _batch(data, B: int, seed: int) -> dict[str, torch.Tensor]:
    idx = torch.randperm(len(data.train["input_ids"]), generator=torch.Generator().manual_seed(seed))[:B]
    return {k: v[idx] for k, v in data.train.items()}


def _refs(batch) -> list[list[int]]:
    return [ids[m.bool()].tolist() for ids, m in zip(batch["input_ids"], batch["attention_mask"])]


def _attack(name: str, data, B: int, seed: int, dropout: float, **settings) -> dict[str, float]:
    """One client step in train mode (dropout active) on a small random model; span-robust's scores."""
    torch.manual_seed(0)
    model = create_model(name, max_len=24, dim=96, depth=3, dropout=dropout)
    batch = _batch(data, B, seed)
    model.train()
    torch.manual_seed(seed)  # the client's dropout masks
    know = Knowledge(batch_size=B, seq_len=24, tokenizer=data.meta["tokenizer"])
    rec = create_attack("span-robust", **settings).reconstruct(observe(model, batch), know)
    return text_report(_refs(batch), rec.token_ids, ignore=SPECIAL)


def test_registered():
    assert "span-robust" in list_attacks()


def test_robust_residual_is_zero_for_a_masked_member_and_not_for_others():
    """A span of 20 dropped vectors in width 128: each clean vector fits with its mask (~1e-7),
    a fresh vector does not; with no dropout allowed the test is the plain span distance."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(20, 128, generator=g, dtype=torch.float64)
    keep = (torch.rand(20, 128, generator=g) > 0.1).double()
    basis = torch.linalg.svd((keep * x / 0.9).T, full_matrices=False)[0]  # (128, 20)
    others = torch.randn(30, 128, generator=g, dtype=torch.float64)
    k = max_dropped(128, 0.1)
    assert robust_residuals(x, basis, k).max() < 1e-6
    assert robust_residuals(others, basis, k).min() > 0.1
    plain = (x - (x @ basis) @ basis.T).norm(dim=1) / x.norm(dim=1)
    assert torch.allclose(robust_residuals(x, basis, 0), plain)
    assert plain.min() > 0.1  # the exact check rejects every true vector


def test_exact_without_dropout(sst2):
    for seed in (0, 2):
        rep = _attack("transformer4", sst2, 1, seed, 0.0)
        assert rep["token_recovery"] == 1.0 and rep["exact_recovery"] == 1.0


@pytest.mark.parametrize("name", ["transformer4", "gpt-tiny"])
def test_recovers_sentences_under_dropout_batch_1(sst2, name):
    """Client dropout 0.1 in train mode: measured exact on 6/6 sentences for both models."""
    reps = [_attack(name, sst2, 1, seed, 0.1) for seed in (0, 1, 3)]
    assert sum(r["token_recovery"] for r in reps) / len(reps) >= 0.9
    assert sum(r["exact_recovery"] for r in reps) >= 2


@pytest.mark.slow
def test_recovers_most_tokens_under_dropout_batch_2(sst2):
    """Batch 2 on the width-96 encoder: measured token_recovery 0.94 / 0.74 / 1 / 0.64 / 1 / 1 (mean 0.89)."""
    reps = [_attack("transformer4", sst2, 2, seed, 0.1) for seed in range(6)]
    assert sum(r["token_recovery"] for r in reps) / len(reps) >= 0.75


def test_bad_settings_say_so(sst2):
    with pytest.raises(VeilError, match="dropout rate"):
        _attack("transformer4", sst2, 1, 0, 0.1, p=1.0)
    with pytest.raises(VeilError, match="max_pairs"):
        _attack("transformer4", sst2, 1, 0, 0.1, max_pairs=10)


def test_batch_size_not_granted_is_read_from_the_pairs(sst2):
    """Without the batch size, B is the most pairs passing at one position (1 here): still exact."""
    torch.manual_seed(0)
    model = create_model("transformer4", max_len=24, dim=96, depth=3, dropout=0.1)
    batch = _batch(sst2, 1, 0)
    model.train()
    torch.manual_seed(0)
    rec = create_attack("span-robust").reconstruct(
        observe(model, batch), Knowledge(seq_len=24, tokenizer=sst2.meta["tokenizer"])
    )
    assert text_report(_refs(batch), rec.token_ids, ignore=SPECIAL)["exact_recovery"] == 1.0
