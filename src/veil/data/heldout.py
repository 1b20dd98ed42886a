"""Validation splits held out of a training file, for choosing a recipe without the test split.

`sst2-val` reads the shipped SST-2 training file only: a seeded `val_size` of its sentences
become the split veil evaluates on (the DataSplits' ``test``), `train_size` of the rest the
training split. The shipped test file is never read, so settings picked on it (e.g. AEGIS's
learning rate and noise on a pretrained decoder, docs/results.md) stay honest on `sst2`'s test.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from veil.data.splits import DataSplits, loader
from veil.data.text import ASSETS, SST2_CLASSES, Encoding, encode_splits, find_file, read_sst2
from veil.errors import VeilError
from veil.registry import DATASETS


@dataclass(frozen=True, kw_only=True)
class HeldOutOptions(Encoding):
    """val_size: training sentences held out (seeded) as the evaluation split (the DataSplits' test;
    `test_size` takes a seeded subset of it)."""

    val_size: int = 872


@DATASETS.register(
    "sst2-val", help="SST-2's training file split into train and a held-out validation split (no test file)"
)
@loader(HeldOutOptions)
def sst2_val(o: HeldOutOptions) -> DataSplits:
    """SST-2 train sentences: `val_size` held out (seeded) as the evaluation split, the rest to train."""
    texts, labels = read_sst2(find_file(ASSETS / "sst2", ["train"], "sst2"))
    if not 1 <= o.val_size < len(texts):
        raise VeilError(f"val_size must be between 1 and {len(texts) - 1}, got {o.val_size}")
    order = np.random.default_rng(o.seed + 7919).permutation(len(texts))
    val, rest = order[: o.val_size], order[o.val_size :]
    data = encode_splits(
        {"train": [texts[i] for i in rest], "test": [texts[i] for i in val]},
        {"train": labels[rest], "test": labels[val]},
        SST2_CLASSES,
        "veil assets (SST-2 training file: train / held-out validation)",
        o,
    )
    data.meta["evaluation_split"] = "validation"
    return data
