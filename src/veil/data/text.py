"""Text classification data: SST-2 and AG News (a small subset ships with veil; `path=` loads the
full data), and `table` for a user's own CSV / TSV / JSONL.

Every loader returns ``input_ids`` and ``attention_mask`` int64 (N, max_len) laid out
``[CLS] tokens [SEP] [PAD] ...`` and ``labels`` int64 (N,); ``meta`` keeps the tokenizer and the
raw texts, which attacks need to decode and score what they recover.
"""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from veil.data.files import column, read_delimited, read_table
from veil.data.splits import DataSplits, stratified_split
from veil.data.tokenizers import Tokenizer, make_tokenizer
from veil.errors import VeilError
from veil.registry import DATASETS

ASSETS = Path(__file__).resolve().parent.parent / "assets"
SST2_CLASSES = ["negative", "positive"]
AGNEWS_CLASSES = ["World", "Sports", "Business", "Sci/Tech"]


def find_file(folder: Path, stems: Sequence[str], what: str) -> Path:
    """The first of ``stem.tsv`` / ``stem.tsv.gz`` present in `folder`."""
    if not folder.is_dir():
        raise VeilError(f"data path {str(folder)!r} does not exist or is not a folder")
    for stem in stems:
        for name in (f"{stem}.tsv", f"{stem}.tsv.gz"):
            if (folder / name).is_file():
                return folder / name
    raise VeilError(f"{what}: no {' or '.join(s + '.tsv' for s in stems)} in {str(folder)!r}")


def take(n_rows: int, size: int | None, seed: int, what: str) -> np.ndarray:
    """Row indices: all in file order, or a seeded random `size` of them."""
    if size is None:
        return np.arange(n_rows)
    if size < 1:
        raise VeilError(f"{what} must be at least 1, got {size}")
    if size > n_rows:
        raise VeilError(f"{what} {size} is larger than the {n_rows} samples available")
    return np.random.default_rng(seed).permutation(n_rows)[:size]


def resolve_tokenizer(tokenizer: str | Tokenizer, corpus: Sequence[str], max_vocab: int) -> Tokenizer:
    """A name builds one (a word vocabulary from the training texts only); an object is reused."""
    return make_tokenizer(tokenizer, corpus, max_vocab) if isinstance(tokenizer, str) else tokenizer


def encode_splits(
    texts: dict[str, list[str]],
    labels: dict[str, np.ndarray],
    class_names: list[str],
    *,
    tokenizer: str | Tokenizer,
    max_len: int,
    train_size: int | None,
    test_size: int | None,
    seed: int,
    max_vocab: int,
    source: str,
) -> DataSplits:
    """Limit each split (seeded), build the tokenizer on training texts, encode both splits."""
    picks = {
        "train": take(len(texts["train"]), train_size, seed, "train_size"),
        "test": take(len(texts["test"]), test_size, seed + 1, "test_size"),
    }
    texts = {s: [texts[s][i] for i in picks[s]] for s in picks}
    tok = resolve_tokenizer(tokenizer, texts["train"], max_vocab)
    splits = {}
    for s in picks:
        ids, mask = tok.encode(texts[s], max_len)
        splits[s] = {
            "input_ids": ids,
            "attention_mask": mask,
            "labels": torch.as_tensor(labels[s][picks[s]], dtype=torch.int64),
        }
    meta = {
        "source": source,
        "tokenizer": tok,
        "tokenizer_name": getattr(tok, "name", type(tok).__name__),
        "vocab_size": tok.vocab_size,
        "max_len": max_len,
        "special_ids": [tok.pad_id, tok.cls_id, tok.sep_id],
        "texts": texts,
    }
    return DataSplits(splits["train"], splits["test"], len(class_names), list(class_names), "text", meta)


def label_ids(values: list[str], path: Path, known: dict[str, int]) -> np.ndarray:
    """Map label strings to ids through `known`; an unexpected label names the allowed ones."""
    out = np.fromiter((known.get(v.strip(), -1) for v in values), dtype=np.int64, count=len(values))
    bad = np.flatnonzero(out < 0)
    if bad.size:
        raise VeilError(f"{path}: label {values[bad[0]]!r} in data row {bad[0] + 1} is not one of: {', '.join(known)}")
    return out


def read_sst2(path: Path) -> tuple[list[str], np.ndarray]:
    """An SST-2 TSV: header ``sentence<TAB>label``, labels 0/1, no quoting."""
    table = read_delimited(path, "\t", quoting=csv.QUOTE_NONE)
    texts = [t.strip() for t in column(table, "sentence", "text", path)]
    labels = label_ids(column(table, "label", "label", path), path, {"0": 0, "1": 1})
    return texts, labels


def read_agnews(path: Path) -> tuple[list[str], np.ndarray]:
    """An AG News TSV: no header; text, label name."""
    table = read_delimited(path, "\t", names=["text", "label"], quoting=csv.QUOTE_NONE)
    labels = label_ids(table["label"], path, {c: i for i, c in enumerate(AGNEWS_CLASSES)})
    return [t.strip() for t in table["text"]], labels


@DATASETS.register("sst2", help="SST-2 movie-review sentiment, 2 classes (8,000/872 shipped; path= for all)")
def sst2(
    path: str | Path | None = None,
    tokenizer: str | Tokenizer = "wordpiece",
    max_len: int = 64,
    train_size: int | None = None,
    test_size: int | None = None,
    seed: int = 0,
    max_vocab: int = 10000,
) -> DataSplits:
    """SST-2; `path` is a folder with train.tsv and test.tsv (header ``sentence<TAB>label``)."""
    folder = ASSETS / "sst2" if path is None else Path(path)
    train = read_sst2(find_file(folder, ["train"], "sst2"))
    test = read_sst2(find_file(folder, ["test"], "sst2"))
    return encode_splits(
        {"train": train[0], "test": test[0]},
        {"train": train[1], "test": test[1]},
        SST2_CLASSES,
        tokenizer=tokenizer,
        max_len=max_len,
        train_size=train_size,
        test_size=test_size,
        seed=seed,
        max_vocab=max_vocab,
        source="veil assets (SST-2 subset)" if path is None else str(path),
    )


@DATASETS.register("agnews", help="AG News topics, 4 classes (4,000/1,000 shipped; path= for all)")
def agnews(
    path: str | Path | None = None,
    tokenizer: str | Tokenizer = "wordpiece",
    max_len: int = 64,
    train_size: int | None = None,
    test_size: int | None = None,
    seed: int = 0,
    max_vocab: int = 10000,
) -> DataSplits:
    """AG News; `path` is a folder with train.tsv (or dev.tsv) and test.tsv, no header: text, label name."""
    folder = ASSETS / "agnews" if path is None else Path(path)
    train = read_agnews(find_file(folder, ["train", "dev"], "agnews"))
    test = read_agnews(find_file(folder, ["test"], "agnews"))
    return encode_splits(
        {"train": train[0], "test": test[0]},
        {"train": train[1], "test": test[1]},
        AGNEWS_CLASSES,
        tokenizer=tokenizer,
        max_len=max_len,
        train_size=train_size,
        test_size=test_size,
        seed=seed,
        max_vocab=max_vocab,
        source="veil assets (AG News subset)" if path is None else str(path),
    )


@DATASETS.register("table", help="your CSV / TSV / JSONL with a text and a label column")
def table(
    path: str | Path,
    text_column: str = "text",
    label_column: str = "label",
    tokenizer: str | Tokenizer = "wordpiece",
    max_len: int = 64,
    test_fraction: float = 0.2,
    train_size: int | None = None,
    test_size: int | None = None,
    seed: int = 0,
    max_vocab: int = 10000,
) -> DataSplits:
    """A user's table; labels are the sorted distinct strings of the label column, split seeded and
    stratified into train/test."""
    data = read_table(path)
    texts = [t.strip() for t in column(data, text_column, "text", path)]
    raw = [v.strip() for v in column(data, label_column, "label", path)]
    if "" in raw:
        raise VeilError(f"{path}: data row {raw.index('') + 1} has an empty label")
    class_names, labels = np.unique(np.array(raw, dtype=str), return_inverse=True)
    if len(class_names) < 2:
        raise VeilError(
            f"{path}: label column {label_column!r} has {len(class_names)} distinct value; a classifier needs at least 2"
        )
    train_idx, test_idx = stratified_split(labels, test_fraction, seed)
    return encode_splits(
        {"train": [texts[i] for i in train_idx], "test": [texts[i] for i in test_idx]},
        {"train": labels[train_idx], "test": labels[test_idx]},
        [str(c) for c in class_names],
        tokenizer=tokenizer,
        max_len=max_len,
        train_size=train_size,
        test_size=test_size,
        seed=seed,
        max_vocab=max_vocab,
        source=str(path),
    )
