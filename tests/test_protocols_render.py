"""Protocols return data; the report renders it: no engine module builds report blocks, and every
protocol's task entry is rendered by `veil.report.protocols`."""

from __future__ import annotations

import ast
from pathlib import Path

from veil.registry import PROTOCOLS
from veil.report.protocols import BLOCKS, protocol_blocks

SRC = Path(__file__).resolve().parent.parent / "src" / "veil"
ENGINES = ("experiments", "federated")
BLOCK_KINDS = {"h2", "h3", "p", "table", "img", "tokens"}


def _offences(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name.endswith("_blocks"):
            out.append(f"{path}:{node.lineno} def {node.name}")
        if (  # a report block: ("h3", ...), ("table", head, rows), ...
            isinstance(node, ast.Tuple)
            and len(node.elts) >= 2
            and isinstance(node.elts[0], ast.Constant)
            and node.elts[0].value in BLOCK_KINDS
        ):
            out.append(f"{path}:{node.lineno} block {node.elts[0].value!r}")
    return out


def test_no_engine_module_builds_report_blocks() -> None:
    found = [o for pkg in ENGINES for f in sorted((SRC / pkg).rglob("*.py")) for o in _offences(f)]
    assert found == []


def test_the_scan_finds_a_planted_renderer(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text('def report_blocks(t, out):\n    return [("h3", "Title"), ("table", [], [])]\n')
    assert len(_offences(bad)) == 3


def test_every_protocol_is_data_only_and_rendered_by_the_report() -> None:
    for name in PROTOCOLS.names():
        proto = PROTOCOLS.create(name)
        assert not hasattr(proto, "report_blocks"), name
    assert set(BLOCKS) <= set(PROTOCOLS.names())
    assert protocol_blocks("t", {"protocol": "single-step"}, Path(".")) == []
