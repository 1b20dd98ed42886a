"""The installed package holds only what a user runs: nothing under src/veil refers to the results
book (`results/`, a repository tool), reaches up the tree with `parents[...]`, or writes to a path
built from its own `__file__` (in a wheel install that is the Python prefix). Reading package data
(assets, configs, the shipped catalog) through `__file__` is allowed."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "veil"

#: a mention of the results book: its module, its old place in the package, its command, an import of it
BOOK = re.compile(r"veil\.report\.results|report/results|python -m results\b|^\s*(?:from|import) results\b", re.M)
#: calls that write: a path's methods, veil.io's helpers, any write*/save*/dump*/copy* function, open(.., "w")
WRITERS = re.compile(r"(write|save|dump|copy|move|replace|mkdir|touch|unlink|rmtree)")


def _file_derived(tree: ast.Module) -> set[str]:
    """Names assigned (anywhere in the module) from an expression that mentions `__file__`, names
    assigned from those (one level more: `FOLDER = HERE / "x"`) and parameters that default to one."""
    names: set[str] = set()
    for _ in range(2):
        for node in ast.walk(tree):
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                used = {n.id for n in ast.walk(node.value) if isinstance(n, ast.Name)}
                if "__file__" in used or used & names:
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    names |= {t.id for t in targets if isinstance(t, ast.Name)}
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):  # `def write(doc: Path = DOC)`
                a = node.args
                pairs = [*zip(a.args[len(a.args) - len(a.defaults) :], a.defaults), *zip(a.kwonlyargs, a.kw_defaults)]
                for arg, default in pairs:
                    if default is not None and {n.id for n in ast.walk(default) if isinstance(n, ast.Name)} & names:
                        names.add(arg.arg)
    return names


def offences(path: Path, text: str) -> list[str]:
    """Where one source file refers to the results book, uses `parents[...]` or writes to a path
    derived from its `__file__` (file:line: what)."""
    book = [f"{path}:{text[: m.start()].count(chr(10)) + 1}: mentions the results book" for m in BOOK.finditer(text)]
    if path.suffix != ".py" or ("__file__" not in text and ".parents" not in text):
        return book
    found: list[tuple[int, str]] = []
    tree = ast.parse(text)
    derived = _file_derived(tree) | {"__file__"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "parents":
            found.append((node.lineno, f"{path}:{node.lineno}: parents[...]"))
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        modes = [*node.args[1:], *(k.value for k in node.keywords if k.arg == "mode")]
        is_open_w = name == "open" and any(
            isinstance(a, ast.Constant) and isinstance(a.value, str) and set(a.value) & set("wax+") for a in modes
        )
        if not WRITERS.search(name) and not is_open_w:
            continue
        parts = [*node.args, *(k.value for k in node.keywords)]
        if isinstance(func, ast.Attribute):
            parts.append(func.value)
        used = {n.id for p in parts for n in ast.walk(p) if isinstance(n, ast.Name)}
        if used & derived:
            names = ", ".join(sorted(used & derived))
            found.append((node.lineno, f"{path}:{node.lineno}: {name} on a path from __file__ ({names})"))
    return book + [what for _, what in sorted(found)]


def test_no_module_of_veil_mentions_the_results_book_or_writes_beside_itself() -> None:
    files = [p for p in sorted(SRC.rglob("*")) if p.suffix in {".py", ".md", ".yaml", ".json", ".txt"}]
    assert len(files) > 100  # the whole package was read
    bad = [o for p in files for o in offences(p.relative_to(ROOT), p.read_text(encoding="utf-8"))]
    assert bad == [], "\n".join(bad)
    assert not (SRC / "report" / "results").exists()


def test_the_check_finds_each_kind_of_offence() -> None:
    planted = '''"""Rendered by `python -m results`."""
from pathlib import Path
ROOT = Path(__file__).resolve().parents[4]
DOC = ROOT / "docs" / "results.md"
HERE = Path(__file__).with_name("cache.json")

def save(text):
    DOC.write_text(text)
    with open(HERE, "w") as f:
        f.write(text)
    Path("out.txt").write_text(text)  # a path the caller's folder gives: allowed
    write(build(), HERE)
    return HERE.read_text()  # reading package data: allowed

def render(doc: Path = DOC) -> None:
    doc.write_text("x")
'''
    got = offences(Path("m.py"), planted)
    assert got == [
        "m.py:1: mentions the results book",
        "m.py:3: parents[...]",
        "m.py:8: write_text on a path from __file__ (DOC)",
        "m.py:9: open on a path from __file__ (HERE)",
        "m.py:12: write on a path from __file__ (HERE)",
        "m.py:16: write_text on a path from __file__ (doc)",
    ]
    assert offences(Path("n.md"), "run `python -m veil.report.results`\n") == ["n.md:1: mentions the results book"]
    assert offences(Path("ok.py"), 'A = Path(__file__).with_name("a.yaml")\nB = A.read_text()\n') == []
