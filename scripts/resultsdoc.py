"""What the remaining results scripts share with the renderer (`veil.report.results`): writing one
section of docs/results.md between its markers, and the one number format `fmt`."""

from __future__ import annotations

from pathlib import Path

from veil.io import atomic_write_text
from veil.report.results import DOC, splice
from veil.report.results.tables import fmt

RESULTS = DOC
__all__ = ["RESULTS", "fmt", "write_section"]


def write_section(name: str, body: str, path: Path = RESULTS) -> None:
    text = path.read_text() if path.is_file() else "# veil results\n"
    atomic_write_text(path, splice(text, name, body.strip()))
