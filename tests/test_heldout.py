"""`sst2-val`: a validation split held out of SST-2's training file; the test file is never read."""

from __future__ import annotations

import pytest

from veil.errors import VeilError


def test_validation_is_disjoint_from_train_and_never_the_test_file() -> None:
    from veil.data import load_data

    d = load_data("sst2-val", tokenizer="word", max_len=16, train_size=300, val_size=200)
    again = load_data("sst2-val", tokenizer="word", max_len=16, train_size=300, val_size=200)
    test = load_data("sst2", tokenizer="word", max_len=16)
    val, train = d.meta["texts"]["test"], d.meta["texts"]["train"]
    assert len(val) == 200 and len(train) == 300 and d.meta["evaluation_split"] == "validation"
    assert not set(val) & set(train)
    assert not set(val) & set(test.meta["texts"]["test"]) and not set(train) & set(test.meta["texts"]["test"])
    assert val == again.meta["texts"]["test"]  # seeded
    with pytest.raises(VeilError, match="val_size must be between 1 and"):
        load_data("sst2-val", val_size=0)
