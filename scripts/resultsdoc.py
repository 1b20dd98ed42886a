"""Write one section of docs/results.md between its markers, keeping every other section; `fmt`
is the one number format of the results scripts' tables."""

from __future__ import annotations

from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results.md"


def write_section(name: str, body: str, path: Path = RESULTS) -> None:
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    block = f"{start}\n{body.strip()}\n{end}"
    text = path.read_text() if path.is_file() else "# veil results\n"
    if start in text and end in text:
        head, rest = text.split(start, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def fmt(v: Any, digits: int = 3) -> str:
    """A table cell: "—" for a missing value, a number to `digits` decimals, anything else as text."""
    if v is None:
        return "—"
    return f"{v:.{digits}f}" if isinstance(v, (int, float)) and not isinstance(v, bool) else str(v)
