"""Defense registry: `create_defense(name, **settings)` / `list_defenses()`.

Each defense module registers itself here on import; see `veil.defenses.base` for the protocol.
"""

from __future__ import annotations

from typing import Any

from veil.defenses.base import Defense, NoDefense
from veil.registry import Registry

DEFENSES: Registry[Defense] = Registry("defense")
DEFENSES.register("none", "no defense")(NoDefense)


def _load_builtin() -> None:
    """Import the defense modules that exist (each registers itself)."""
    import importlib

    for mod in ("mjp", "aegis", "baselines", "permutation"):
        try:
            importlib.import_module(f"veil.defenses.{mod}")
        except ModuleNotFoundError as e:
            if e.name != f"veil.defenses.{mod}":
                raise


def create_defense(name: str, **settings: Any) -> Defense:
    _load_builtin()
    return DEFENSES.create(name, **settings)


def list_defenses() -> list[str]:
    _load_builtin()
    return DEFENSES.names()


__all__ = ["DEFENSES", "Defense", "NoDefense", "create_defense", "list_defenses"]
