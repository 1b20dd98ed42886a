"""What `veil list` prints — every registered model, data set, defense and attack with its
options (type, default, help) — read from the builders' signatures, and kept in a JSON file so
that listing does not import torch.

The file records a fingerprint of the sources components come from (a SHA-256 of the .py files
of models/, data/, defenses/, attacks/ and the registry, schema and config modules). A
catalog whose fingerprint matches the installed sources is used as is; otherwise the registries
are imported (seconds), and the fresh catalog is written to the user cache
($XDG_CACHE_HOME/veil, else ~/.cache/veil), so the next call is fast again. `python -m
veil.commands.catalog [OUT]`, run from the repository root, rewrites the copy shipped in the package
(OUT defaults to `src/veil/commands/catalog.json` under the current folder; the module never
writes beside its own file, which in an installed package is the Python prefix).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import veil
from veil.registry import ATTACKS, DATASETS, DEFENSES, MODELS  # cheap: a registry imports its modules on first lookup
from veil.schema import REQUIRED

PACKAGE = Path(veil.__file__).resolve().parent
SHIPPED = Path(__file__).with_name("catalog.json")
KINDS = ("models", "data sets", "defenses", "attacks")


#: the sources a component's name, help and options can come from
SOURCES = ("models", "data", "defenses", "attacks", "registry.py", "schema.py", "config.py", "commands/catalog.py")


def fingerprint() -> str:
    h = hashlib.sha256(veil.__version__.encode())
    files = [p for s in SOURCES for p in ((PACKAGE / s).rglob("*.py") if (PACKAGE / s).is_dir() else [PACKAGE / s])]
    for path in sorted(files):
        h.update(str(path.relative_to(PACKAGE)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def cache_path() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "veil" / "catalog.json"


def load() -> dict[str, Any]:
    """The catalog for the installed sources: shipped or cached when current, else built (and cached)."""
    fp = fingerprint()
    for path in (SHIPPED, cache_path()):
        try:
            cat = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(cat, dict) and cat.get("fingerprint") == fp:
            return cat
    cat = build(fp)
    with contextlib.suppress(OSError):  # a read-only home: list from the live registries every time
        write(cat, cache_path())
    return cat


def write(cat: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(cat, indent=1, sort_keys=True))
    os.replace(tmp, path)


def build(fp: str | None = None) -> dict[str, Any]:
    """Import every registry and read each component's help and options."""
    from veil.attacks import attack_checks  # `veil list` with a current catalog imports no attack package

    kinds: dict[str, dict[str, Any]] = {}
    for kind, reg, schema in (
        ("models", MODELS, MODELS.options),
        ("data sets", DATASETS, DATASETS.options),
        ("defenses", DEFENSES, DEFENSES.options),
        ("attacks", ATTACKS, _attack_options),
    ):
        kinds[kind] = {name: {"help": help, "options": _rows(schema(name))} for name, help in reg.describe().items()}
    for name, entry in kinds["attacks"].items():  # what `veil attack` checks options against, torch-free
        entry.update(attack_checks(name))
    return {"fingerprint": fp or fingerprint(), "kinds": kinds}


def _rows(options: Any) -> list[list[str]] | None:
    if options is None:
        return None
    return [
        [o.name, o.type_name(), o.default if o.default is REQUIRED else repr(o.default), o.help]
        for o in options.values()
    ]


def _attack_options(name: str) -> Any:
    """An attack's declared options (`veil.attacks.attack_options`): name, type, default, help."""
    from veil.attacks import attack_options  # as in build()

    return attack_options(name)


#: where the maintainer's copy lives, relative to the repository root
CHECKOUT_COPY = Path("src") / "veil" / "commands" / "catalog.json"

if __name__ == "__main__":
    import sys

    out = Path(sys.argv[1]) if len(sys.argv) > 1 else CHECKOUT_COPY
    if not out.parent.is_dir():
        sys.exit(f"veil: no folder '{out.parent}' (run from the repository root, or name the catalog file to write)")
    write(build(), out)
    print(f"wrote {out}")
