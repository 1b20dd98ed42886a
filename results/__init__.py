"""The results book: docs/results.md rendered from the audit engine's cached summaries.

A repository tool beside `benchmarks/`, not part of the installed `veil` package; run it from the
repository root (`python -m results`). Every path it reads or writes comes from its arguments: the
document (default `docs/results.md` under the current folder), the summaries cached beside it
(`DOCS_FOLDER/results/`) and their figures (`DOCS_FOLDER/figures/`).

Every section of docs/results.md sits between `<!-- NAME:start -->` and `<!-- NAME:end -->`.
A section the engine produces is a `veil audit configs/paper/*.yaml` scenario: its run's
summary.json is copied (`collect`, hashed as `veil.io` writes a cached result) to
`docs/results/SOURCE.json`, and `sections/NAME.py` renders it (`render(summary) -> str`; a
section reading several runs names them in `SOURCES` and gets {source: summary}; those of them in
`OPTIONAL` may be missing). Rewriting
the document reads only those JSON files: no training, no attack. A section's prose (what it
measures, how it was made) is Markdown in `notes/NAME.md` (`results.notes`). A section with no module, or
whose sources are not collected yet, is left as it stands (the benchmark-produced ones: their
figures are timings, made by `benchmarks/` scripts).

    python -m results collect RUN_DIR [--name SOURCE] [--docs PATH]   # summary.json -> docs/results/
    python -m results [--check] [--docs PATH]                          # rewrite (or diff) docs/results.md

This package renders summary dicts and imports nothing from `veil.experiments`.
"""

from __future__ import annotations

import difflib
import importlib
import json
import pkgutil
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from veil.errors import VeilError
from veil.io import atomic_write_text, intact, write_checked_text

#: the document, relative to the current folder unless a caller passes another
DOC = Path("docs") / "results.md"


def cache_of(doc: Path) -> Path:
    """The folder of collected summaries that belongs to document `doc` (beside it: `results/`)."""
    return Path(doc).parent / "results"


def figures_of(doc: Path) -> Path:
    """The folder of collected figures that belongs to document `doc` (beside it: `figures/`)."""
    return Path(doc).parent / "figures"


CACHE = cache_of(DOC)
FIGURES = figures_of(DOC)
#: summary keys no section renders, dropped when a run is collected (they only make the cache big)
DROPPED = ("versions",)


@dataclass(frozen=True)
class Section:
    name: str  # the marker name in docs/results.md
    module: ModuleType

    @property
    def sources(self) -> tuple[str, ...]:
        return tuple(getattr(self.module, "SOURCES", (self.name,)))


def all_sections() -> list[Section]:
    """Every section module under `sections/` (file `span_robust.py` renders marker `span-robust`)."""
    from results import sections as pkg

    found = []
    for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda i: i.name):
        module = importlib.import_module(f"{pkg.__name__}.{info.name}")
        found.append(Section(getattr(module, "NAME", info.name.replace("_", "-")), module))
    return found


def load(source: str, cache: Path = CACHE) -> dict[str, Any] | None:
    """A collected summary, or None when it is not collected yet; a damaged one is refused."""
    path = cache / f"{source}.json"
    if not path.is_file():
        return None
    if not intact(path):
        raise VeilError(f"'{path}' does not match its recorded hash; collect its run again")
    return json.loads(path.read_text())


def collected(cache: Path = CACHE) -> list[str]:
    return sorted(p.stem for p in cache.glob("*.json"))


def render_section(section: Section, cache: Path = CACHE) -> str | None:
    """The section's Markdown, or None while one of its sources is missing (a source the module
    lists in `OPTIONAL` may be missing: the section then gets the others and says what is not in)."""
    names = collected(cache) if section.sources == ("*",) else list(section.sources)
    optional = set(getattr(section.module, "OPTIONAL", ()))
    found = {n: load(n, cache) for n in names}
    if not found or any(v is None for n, v in found.items() if n not in optional):
        return None
    found = {n: v for n, v in found.items() if v is not None}
    arg = found if len(section.sources) > 1 or section.sources == ("*",) else found[names[0]]
    return section.module.render(arg).strip()


def splice(text: str, name: str, body: str) -> str:
    """`text` with the block between NAME's markers replaced by `body` (appended when absent)."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    block = f"{start}\n{body}\n{end}"
    if start in text and end in text:
        head, rest = text.split(start, 1)
        return head + block + rest.split(end, 1)[1]
    return text.rstrip() + "\n\n" + block + "\n"


def render_doc(text: str, cache: Path = CACHE) -> tuple[str, list[str]]:
    """`text` with every section that has its sources re-rendered; also the names rendered."""
    done = []
    for section in all_sections():
        body = render_section(section, cache)
        if body is not None:
            text = splice(text, section.name, body)
            done.append(section.name)
    return text, done


def collect(run_dir: Path, name: str | None = None, cache: Path = CACHE, figures: Path = FIGURES) -> Path:
    """Copy RUN_DIR/summary.json (less DROPPED) to docs/results/NAME.json, atomically, hashed; a
    task's own figure (`tasks[t].figure`, e.g. a FedAvg audit's per-round plot) goes to
    docs/figures/NAME_FILE, and the task records it as `figure_doc` (relative to docs/)."""
    src = Path(run_dir) / "summary.json"
    if not src.is_file():
        raise VeilError(f"'{run_dir}' holds no summary.json (run `veil audit SCENARIO --out {run_dir}` first)")
    if not intact(src):
        raise VeilError(f"'{src}' does not match its recorded hash; rerun the audit")
    summary = {k: v for k, v in json.loads(src.read_text()).items() if k not in DROPPED}
    name = name or str(summary.get("scenario") or Path(run_dir).name)
    for t in (summary.get("tasks") or {}).values():
        fig = Path(run_dir) / str(t.get("figure") or "")
        if t.get("figure") and fig.is_file():
            figures.mkdir(parents=True, exist_ok=True)
            dest_fig = figures / f"{name}_{fig.name}"
            dest_fig.write_bytes(fig.read_bytes())
            t["figure_doc"] = f"{figures.name}/{dest_fig.name}"
    cache.mkdir(parents=True, exist_ok=True)
    dest = cache / f"{name}.json"
    write_checked_text(dest, json.dumps(summary, indent=1, sort_keys=False) + "\n")
    return dest


def check(doc: Path = DOC, cache: Path = CACHE) -> str:
    """The unified diff between docs/results.md and its re-rendering ('' when they agree)."""
    old = doc.read_text()
    new, _ = render_doc(old, cache)
    return "".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True), str(doc), "rendered"))


def write(doc: Path = DOC, cache: Path = CACHE) -> list[str]:
    new, done = render_doc(doc.read_text(), cache)
    atomic_write_text(doc, new)
    return done
