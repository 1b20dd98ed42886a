"""The prose of the results sections (what a table measures, how it was made, what changed),
kept as Markdown beside the code that renders the tables: `notes/NAME.md` for the section module
`sections/NAME.py`. A file holds named blocks, each opened by a line ``<!-- KEY -->`` and running
to the next such line; a block's text is used as written (``str.format`` fields included), less
the blank lines around it. A block of lines ``- `KEY`: text`` reads as a dict with `labelled`."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

from veil.errors import VeilError

FOLDER = Path(__file__).with_name("notes")
_KEY = re.compile(r"^<!-- ([A-Z][A-Z0-9_]*) -->\n", re.M)


def parse(text: str) -> dict[str, str]:
    """The named blocks of one notes file (text before the first key is ignored)."""
    parts = _KEY.split(text)
    return {key: body.strip("\n") for key, body in zip(parts[1::2], parts[2::2])}


@cache
def notes(module: str) -> dict[str, str]:
    """The blocks of the notes file of section module `module` (its `__name__`)."""
    path = FOLDER / f"{module.rsplit('.', 1)[-1]}.md"
    if not path.is_file():
        raise VeilError(f"results section {module}: no notes file {path.name} in {FOLDER}")
    return parse(path.read_text(encoding="utf-8"))


_ITEM = re.compile(r"^- `([^`]+)`: (.+)$")


def labelled(block: str) -> dict[str, str]:
    """A block of lines ``- `KEY`: text`` as {KEY: text} (e.g. what each defense label of a table is)."""
    items = [_ITEM.match(line) for line in block.splitlines() if line.strip()]
    bad = [line for line, m in zip(block.splitlines(), items) if m is None]
    if bad:
        raise VeilError(f"results notes: a labelled block has a line that is not '- `KEY`: text': {bad[0]!r}")
    return {m.group(1): m.group(2) for m in items if m is not None}
