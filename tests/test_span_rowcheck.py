"""The span attack's embedding-row test (`veil.attacks.span.checks.RowCheck`): where a mean-pooled
encoder's batch holds more tokens than the last block's span can separate, a sentence is tested by
its token-embedding gradient rows, at any B*T."""

from __future__ import annotations

import pytest
import torch

from veil.attacks.base import observe
from veil.attacks.span.checks import CLSCheck, RowCheck, exact_check
from veil.attacks.span.options import DEFAULTS, SpanOptions
from veil.attacks.span.residual import Residual
from veil.data import load_data
from veil.models import create_model


@pytest.fixture(scope="module")
def crowded():
    """A mean-pooled BERT of width 32 and 4 SST-2 sentences of 39 real tokens: more rows than the
    width, so the last block's Q gradient leaves no gap."""
    data = load_data("sst2", max_len=24, train_size=300, seed=0)
    mask = data.train["attention_mask"]
    ok = torch.nonzero(mask.sum(1) <= 12).flatten()
    idx = ok[torch.randperm(len(ok), generator=torch.Generator().manual_seed(1))[:4]]
    batch = {k: v[idx] for k, v in data.train.items()}
    torch.manual_seed(0)
    model = create_model("hf-bert", dim=32, depth=2, heads=4, max_len=24, dropout=0.0)
    model.pooling = "mean"
    model.eval()
    sents = [ids[m.bool()].tolist() for ids, m in zip(batch["input_ids"], batch["attention_mask"])]
    return model, batch, sents


def test_the_row_test_applies_where_the_span_test_has_no_gap(crowded) -> None:
    model, batch, sents = crowded
    res = Residual(observe(model, batch), len(sents))
    assert sum(map(len, sents)) > 32 and not CLSCheck(res).usable
    check = exact_check(res, DEFAULTS)
    assert isinstance(check, RowCheck) and check.usable and check.tol == DEFAULTS.tol_row
    off = exact_check(res, SpanOptions(row_check=False))
    assert isinstance(off, CLSCheck) and not off.usable


def test_true_sentences_pass_and_one_wrong_token_fails(crowded) -> None:
    """Every true sentence matches its rows at float rounding; each single-token change of every
    sentence misses them by more than the tolerance."""
    model, batch, sents = crowded
    check = RowCheck(Residual(observe(model, batch), len(sents)), tol=DEFAULTS.tol_row)
    for s in sents:
        assert float(check.sentences(model, torch.tensor([s]))) < 1e-6
        wrong = []
        for j in range(1, len(s) - 1):
            x = list(s)
            x[j] = 2000 if s[j] != 2000 else 2001
            wrong.append(x)
        assert float(check.sentences(model, torch.tensor(wrong)).min()) > check.tol


def test_peeling_by_rows_infers_each_label(crowded) -> None:
    """Subtracting a sentence with the label whose rows match leaves the others' rows: each label is
    the true one and the next sentence still passes the test on the residual."""
    model, batch, sents = crowded
    res = Residual(observe(model, batch), len(sents))
    for k, s in enumerate(sents):
        check = RowCheck(res)
        assert float(check.sentences(model, torch.tensor([s]))) < 1e-6
        label, miss = res.peel(s, check)
        assert label == int(batch["labels"][k]) and miss < 1e-6
    assert res.left == 0 and not RowCheck(res).usable
