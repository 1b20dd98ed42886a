"""Defense registry: `create_defense(name, **settings)` / `list_defenses()`.

Each defense module registers itself into `veil.registry.DEFENSES`, which imports the modules it
lists on first lookup; see `veil.defenses.base` for the protocol.
"""

from __future__ import annotations

from typing import Any

from veil.defenses.base import Defense, NoDefense
from veil.registry import DEFENSES

DEFENSES.register("none", "no defense")(NoDefense)


def create_defense(name: str, **settings: Any) -> Defense:
    return DEFENSES.create(name, **settings)


def list_defenses() -> list[str]:
    return DEFENSES.names()


__all__ = ["DEFENSES", "Defense", "NoDefense", "create_defense", "list_defenses"]
