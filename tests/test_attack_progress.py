"""Visible searches: a long attack shows a bar over its counted work inside one update when a
terminal watches (`attack_progress`), and nothing otherwise."""

from __future__ import annotations

import pytest
import torch

from veil.attacks import create_attack
from veil.attacks.base import attack_progress
from veil.attacks.harness import attack_once
from veil.data import load_data
from veil.defenses import create_defense
from veil.models import create_model


@pytest.fixture(scope="module")
def digits():
    return load_data("digits", train_size=64, test_size=8)


@pytest.mark.parametrize("solver", ["lm", "lbfgs"])
def test_april_mjp_shows_its_iterations(digits, solver: str, capsys: pytest.CaptureFixture[str]) -> None:
    torch.manual_seed(0)
    model = create_model("vit-digits", depth=1, dim=32, heads=2).double().train()
    d = create_defense("mjp", gamma=0.27, seed=3)
    d.attach(model)
    batch = {"pixels": digits.test["pixels"][:1].double(), "labels": digits.test["labels"][:1]}
    attack = create_attack("april-mjp", iterations=3, restarts=1, solver=solver)
    with attack_progress(True):
        attack_once(attack, model, batch, [d], digits, "original", 0)
    err = capsys.readouterr().err
    assert "april-mjp" in err and "/3" in err, err[-300:]
    attack_once(attack, model, batch, [d], digits, "original", 0)  # off by default: silent
    assert "april-mjp" not in capsys.readouterr().err


def test_span_shows_the_sentences_it_scored(capsys: pytest.CaptureFixture[str]) -> None:
    """The peeling search's bar counts sentences scored against the budget, every stage together."""
    from veil.attacks import Knowledge, observe

    torch.manual_seed(0)
    sst2 = load_data("sst2", max_len=24, train_size=300, seed=0)
    model = create_model("transformer4", max_len=24, dim=96, depth=3).eval()
    batch = {k: v[:8] for k, v in sst2.train.items()}
    know = Knowledge(batch_size=8, seq_len=24, tokenizer=sst2.meta["tokenizer"])
    with attack_progress(True):
        rec = create_attack("span", budget=3_000).reconstruct(observe(model, batch), know)
    err = capsys.readouterr().err
    assert rec.stats["search"] == "peel"
    assert "span" in err and "/3000" in err, err[-300:]


def test_span_default_budget_bounds_sentences_and_block_rows() -> None:
    """The default caps the search at 100,000 scored sentences (a fifth of the old 500,000) and
    at 400,000 block-rows per batch sentence: the second unit bounds the last stage of a slow
    update, where each scored sentence costs a whole row of block 1 (docs/span.md)."""
    for name in ("span", "span-mjp"):
        assert create_attack(name).budget() == {"sentences_scored": 100_000, "block_rows": 400_000}
