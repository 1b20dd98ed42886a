"""The results sections' prose files (`results.notes`)."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import results.sections as sections
from results.notes import FOLDER, labelled, notes, parse
from veil.errors import VeilError


def test_parse_reads_named_blocks_as_written() -> None:
    text = "ignored\n<!-- NOTE -->\nLine one {seeds}.\n\nSecond paragraph.\n\n<!-- CAVEAT_2 -->\nlast\n"
    assert parse(text) == {"NOTE": "Line one {seeds}.\n\nSecond paragraph.", "CAVEAT_2": "last"}


def test_labelled_reads_key_text_lines_and_refuses_any_other_line() -> None:
    assert labelled("- `none`: undefended\n\n- `aegis(x=1.0)`: a: b\n") == {
        "none": "undefended",
        "aegis(x=1.0)": "a: b",
    }
    with pytest.raises(VeilError, match="not '- `KEY`: text': 'none: undefended'"):
        labelled("- `aegis`: ok\nnone: undefended")


def test_a_section_without_its_notes_file_names_the_file() -> None:
    with pytest.raises(VeilError, match="no notes file nosuch.md"):
        notes("results.sections.nosuch")


def test_every_notes_file_belongs_to_a_section_that_reads_it() -> None:
    names = {m.name for m in pkgutil.iter_modules(sections.__path__)}
    files = sorted(FOLDER.glob("*.md"))
    assert files and {f.stem for f in files} <= names
    for f in files:
        module = importlib.import_module(f"results.sections.{f.stem}")
        assert parse(f.read_text()) == module.NOTES and module.NOTES
