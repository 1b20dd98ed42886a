"""Text classification data: SST-2 and AG News (a small subset ships with veil; `path=` loads the
full data), and `table` for a user's own CSV / TSV / JSONL.

Every loader returns ``input_ids`` and ``attention_mask`` int64 (N, max_len) laid out
``[CLS] tokens [SEP] [PAD] ...`` and ``labels`` int64 (N,); ``meta`` keeps the tokenizer and the
raw texts, which attacks need to decode and score what they recover.
"""

from __future__ import annotations

import csv
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from veil.data.files import column, read_delimited, read_table
from veil.data.splits import DataSplits, Limits, PoolLimits, loader, stratified_split
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


@dataclass(frozen=True, kw_only=True)
class Encoding(Limits):
    """The options of a text loader: how its texts become token ids.

    tokenizer: 'wordpiece' (the pretrained MiniLM vocabulary, shipped), 'word' (a word vocabulary built on the training texts) or a Hugging Face checkpoint folder (its tokenizer; with model hf, the model folder's unless set).
    max_len: tokens per text, [CLS] and [SEP] included (longer texts are cut, shorter ones padded).
    max_vocab: most words a 'word' vocabulary keeps.
    """

    tokenizer: str | Tokenizer = "wordpiece"
    max_len: int = 64
    max_vocab: int = 10000


@dataclass(frozen=True, kw_only=True)
class ShippedOptions(Encoding):
    """path: a folder with the whole data set's files (unset: the subset veil ships)."""

    path: str | Path | None = None


@dataclass(frozen=True, kw_only=True)
class TableOptions(Encoding, PoolLimits):
    """The options of a user's table.

    path: a CSV, TSV or JSONL file.
    text_column: the column that holds the texts.
    label_column: the column that holds the labels.
    """

    path: str | Path
    text_column: str = "text"
    label_column: str = "label"


def encode_splits(
    texts: dict[str, list[str]], labels: dict[str, np.ndarray], class_names: list[str], source: str, enc: Encoding
) -> DataSplits:
    """Limit each split (seeded), build the tokenizer on training texts, encode both splits."""
    picks = {
        "train": take(len(texts["train"]), enc.train_size, enc.seed, "train_size"),
        "test": take(len(texts["test"]), enc.test_size, enc.seed + 1, "test_size"),
    }
    texts = {s: [texts[s][i] for i in picks[s]] for s in picks}
    tok = resolve_tokenizer(enc.tokenizer, texts["train"], enc.max_vocab)
    splits = {}
    for s in picks:
        ids, mask = tok.encode(texts[s], enc.max_len)
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
        "max_len": enc.max_len,
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


Reader = Callable[[Path], tuple[list[str], np.ndarray]]


def shipped(name: str, read: Reader, train_stems: list[str], classes: list[str], label: str, doc: str) -> Callable:
    """The loader of a text set veil ships a subset of (assets/NAME), or reads whole from `path`."""

    def load(o: ShippedOptions) -> DataSplits:
        folder = ASSETS / name if o.path is None else Path(o.path)
        train = read(find_file(folder, train_stems, name))
        test = read(find_file(folder, ["test"], name))
        source = f"veil assets ({label} subset)" if o.path is None else str(o.path)
        return encode_splits(
            {"train": train[0], "test": test[0]}, {"train": train[1], "test": test[1]}, classes, source, o
        )

    load.__name__ = load.__qualname__ = name
    load.__doc__ = doc
    return loader(ShippedOptions)(load)


#: the shipped text sets: name -> (help, reader, train file stems, classes, what the subset is of, docstring)
SHIPPED: dict[str, tuple[str, Reader, list[str], list[str], str, str]] = {
    "sst2": (
        "SST-2 movie-review sentiment, 2 classes (8,000/872 shipped; path= for all)",
        read_sst2,
        ["train"],
        SST2_CLASSES,
        "SST-2",
        "SST-2; `path` is a folder with train.tsv and test.tsv (header ``sentence<TAB>label``).",
    ),
    "agnews": (
        "AG News topics, 4 classes (4,000/1,000 shipped; path= for all)",
        read_agnews,
        ["train", "dev"],
        AGNEWS_CLASSES,
        "AG News",
        "AG News; `path` is a folder with train.tsv (or dev.tsv) and test.tsv, no header: text, label name.",
    ),
}
for _name, (_help, *_spec) in SHIPPED.items():
    DATASETS.register(_name, help=_help)(shipped(_name, *_spec))


@DATASETS.register("table", help="your CSV / TSV / JSONL with a text and a label column")
@loader(TableOptions)
def table(o: TableOptions) -> DataSplits:
    """A user's table; labels are the sorted distinct strings of the label column, split seeded and
    stratified into train/test."""
    path = o.path
    data = read_table(path)
    texts = [t.strip() for t in column(data, o.text_column, "text", path)]
    raw = [v.strip() for v in column(data, o.label_column, "label", path)]
    if "" in raw:
        raise VeilError(f"{path}: data row {raw.index('') + 1} has an empty label")
    class_names, labels = np.unique(np.array(raw, dtype=str), return_inverse=True)
    if len(class_names) < 2:
        raise VeilError(
            f"{path}: label column {o.label_column!r} has {len(class_names)} distinct value; a classifier needs at least 2"
        )
    train_idx, test_idx = stratified_split(labels, o.test_fraction, o.seed)
    texts = {"train": [texts[i] for i in train_idx], "test": [texts[i] for i in test_idx]}
    names = [str(c) for c in class_names]
    return encode_splits(texts, {"train": labels[train_idx], "test": labels[test_idx]}, names, str(path), o)
