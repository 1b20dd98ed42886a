"""Draw the small SST-2 and AG News subsets shipped in ``src/veil/assets``.

Usage: python scripts/make_data_subset.py /path/to/full/data [--out src/veil/assets] [--seed 0]

The full-data folder holds ``sst2/{train,test}.tsv`` (header ``sentence\\tlabel``) and
``agnews/{dev,test}.tsv`` (no header; text, label name). Rows are copied unchanged; only which
rows is decided here, so rerunning with the same seed reproduces the shipped files byte for byte.
"""

from __future__ import annotations

import argparse
import csv
import gzip
from pathlib import Path

import numpy as np

SST2_TRAIN_ROWS = 8000
SST2_MIN_WORDS = 5
AGNEWS_TRAIN_ROWS = 4000
AGNEWS_TEST_ROWS = 1000


def read_tsv(path: Path, header: bool) -> tuple[list[str] | None, list[list[str]]]:
    """Rows of a tab-separated file, read verbatim (no quote handling)."""
    with path.open(encoding="utf-8", newline="") as f:
        rows = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    return (rows[0], rows[1:]) if header else (None, rows)


def write_tsv_gz(path: Path, head: list[str] | None, rows: list[list[str]]) -> None:
    """Write rows gzip-compressed, with a fixed mtime so the bytes are reproducible."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = (["\t".join(head)] if head else []) + ["\t".join(r) for r in rows]
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, filename="") as f:
        f.write(("\n".join(lines) + "\n").encode("utf-8"))


def balanced_sample(labels: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """Indices of n rows, equal numbers per class, in file order."""
    classes = np.unique(labels)
    per = n // len(classes)
    picks = [rng.choice(np.flatnonzero(labels == c), per, replace=False) for c in classes]
    return np.sort(np.concatenate(picks))


def sst2(src: Path, out: Path, rng: np.random.Generator) -> None:
    """SST-2: seeded sample of distinct training rows with >= 5 words; the full GLUE-dev test."""
    head, rows = read_tsv(src / "sst2" / "train.tsv", header=True)
    seen: set[str] = set()
    keep = []
    for i, (sentence, _) in enumerate(rows):
        key = sentence.strip()
        if len(key.split()) >= SST2_MIN_WORDS and key not in seen:
            seen.add(key)
            keep.append(i)
    pick = np.sort(rng.choice(np.array(keep), SST2_TRAIN_ROWS, replace=False))
    write_tsv_gz(out / "sst2" / "train.tsv.gz", head, [rows[i] for i in pick])
    head, test = read_tsv(src / "sst2" / "test.tsv", header=True)
    write_tsv_gz(out / "sst2" / "test.tsv.gz", head, test)


def agnews(src: Path, out: Path, rng: np.random.Generator) -> None:
    """AG News: class-balanced seeded samples, train from dev.tsv, test from test.tsv."""
    for name, split, n in [("dev.tsv", "train", AGNEWS_TRAIN_ROWS), ("test.tsv", "test", AGNEWS_TEST_ROWS)]:
        _, rows = read_tsv(src / "agnews" / name, header=False)
        pick = balanced_sample(np.array([r[1] for r in rows]), n, rng)
        write_tsv_gz(out / "agnews" / f"{split}.tsv.gz", None, [rows[i] for i in pick])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("data", type=Path, help="folder holding sst2/ and agnews/")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "src" / "veil" / "assets")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    sst2(args.data, args.out, rng)
    agnews(args.data, args.out, rng)
    for p in sorted(args.out.rglob("*.tsv.gz")):
        print(f"{p.relative_to(args.out)}: {p.stat().st_size / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
