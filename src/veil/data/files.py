"""Reading a text table (CSV, TSV, JSONL, optionally gzipped) into named string columns.

Every problem a user's file can have becomes one `VeilError` line naming the file and the fix.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
from pathlib import Path

from veil.errors import VeilError

Columns = dict[str, list[str]]
FORMATS = {".csv": "csv", ".tsv": "tsv", ".txt": "tsv", ".jsonl": "jsonl", ".ndjson": "jsonl"}


def file_format(path: Path) -> str:
    """'csv', 'tsv' or 'jsonl' from the suffix (a trailing .gz is looked through)."""
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] == ".gz":
        suffixes = suffixes[:-1]
    fmt = FORMATS.get(suffixes[-1]) if suffixes else None
    if fmt is None:
        raise VeilError(f"cannot tell the format of {str(path)!r}; name it .csv, .tsv or .jsonl (optionally .gz)")
    return fmt


def read_text(path: Path) -> str:
    """The whole file as text (UTF-8, BOM tolerated; .gz decompressed)."""
    if not path.exists():
        raise VeilError(f"data path {str(path)!r} does not exist")
    if path.is_dir():
        raise VeilError(f"data path {str(path)!r} is a folder; give a file")
    raw = path.read_bytes()
    if path.suffix.lower() == ".gz":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as e:
            raise VeilError(f"cannot decompress {str(path)!r}: {e}") from None
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise VeilError(f"{str(path)!r} is not UTF-8 text (byte {e.start})") from None


def read_delimited(
    path: Path, delimiter: str, names: list[str] | None = None, quoting: int = csv.QUOTE_MINIMAL
) -> Columns:
    """Columns of a delimited file; its header names them unless `names` is given (headerless file)."""
    rows = csv.reader(io.StringIO(read_text(path), newline=""), delimiter=delimiter, quoting=quoting)
    try:
        header = names if names is not None else next(rows, None)
        body = [r for r in rows if r and any(f.strip() for f in r)]
    except csv.Error as e:
        raise VeilError(f"cannot parse {str(path)!r}: {e}") from None
    if not header or not body:
        raise VeilError(f"data set is empty: {path}")
    header = [h.strip() for h in header]
    bad = next((i for i, r in enumerate(body) if len(r) != len(header)), None)
    if bad is not None:
        raise VeilError(
            f"{path}: data row {bad + 1} has {len(body[bad])} fields but there are "
            f"{len(header)} columns ({', '.join(header)})"
        )
    return {h: [r[j] for r in body] for j, h in enumerate(header)}


def read_jsonl(path: Path) -> Columns:
    """Columns of a JSON-lines file: one object per line; keys are the columns."""
    records = []
    for n, line in enumerate(read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise VeilError(f"{path} line {n} is not valid JSON: {e.msg}") from None
        if not isinstance(obj, dict):
            raise VeilError(f'{path} line {n} is not a JSON object; each line must be {{"column": value, ...}}')
        records.append(obj)
    if not records:
        raise VeilError(f"data set is empty: {path}")
    keys = list(dict.fromkeys(k for r in records for k in r))
    return {k: ["" if r.get(k) is None else str(r.get(k)) for r in records] for k in keys}


def read_table(path: str | Path) -> Columns:
    """A user's CSV / TSV / JSONL file as {column: values}, all values strings."""
    p = Path(path)
    fmt = file_format(p)
    if fmt == "jsonl":
        return read_jsonl(p)
    return read_delimited(p, "," if fmt == "csv" else "\t")


def column(table: Columns, name: str, role: str, path: str | Path) -> list[str]:
    """One column by name; a missing one lists those the file has."""
    if name not in table:
        tabs = any("\t" in c for c in table)  # a tab-separated header read as one comma-separated column
        hint = "; the file looks tab-separated: name it .tsv (or .tsv.gz)" if tabs else ""
        shown = ", ".join(c.replace("\t", "\\t") for c in table)
        raise VeilError(f"{role} column {name!r} not found in {path}; columns are: {shown}{hint}")
    return table[name]
