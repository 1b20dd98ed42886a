"""Real, offline data for veil: images (digits, LFW faces, your folder) and text (SST-2, AG News,
your table), as train/test tensor dicts with the batch keys the models read.

    from veil.data import load_data, list_datasets, iterate_batches
    data = load_data("sst2", tokenizer="word", max_len=32, train_size=1000)
    for batch in iterate_batches(data.train, 32, shuffle=True, generator=torch.Generator().manual_seed(0)):
        loss = model.loss(model(batch), batch)
"""

from __future__ import annotations

from typing import Any

from veil.data.partition import dirichlet, iid, label_skew
from veil.data.splits import DataSplits, Split, iterate_batches, split_size, stratified_split, subset
from veil.data.tokenizers import Tokenizer, WordPieceTokenizer, WordTokenizer, make_tokenizer, minilm_dir
from veil.registry import DATASETS

__all__ = [
    "DATASETS",
    "DataSplits",
    "Split",
    "Tokenizer",
    "WordPieceTokenizer",
    "WordTokenizer",
    "dirichlet",
    "iid",
    "iterate_batches",
    "label_skew",
    "list_datasets",
    "load_data",
    "make_tokenizer",
    "minilm_dir",
    "split_size",
    "stratified_split",
    "subset",
]


def load_data(name: str, **kwargs: Any) -> DataSplits:
    """Build a registered data set by name (see `list_datasets`); kwargs go to its loader."""
    return DATASETS.create(name, **kwargs)


def list_datasets() -> dict[str, str]:
    """Registered data set names with a one-line description each."""
    return DATASETS.describe()
