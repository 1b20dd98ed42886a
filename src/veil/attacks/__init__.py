"""Attack registry: `create_attack(name, **settings)` / `list_attacks()`; one family per file."""

from __future__ import annotations

import importlib
from typing import Any

from veil.attacks.base import Attack, Knowledge, LocalTraining, Observation, Reconstruction, observe
from veil.registry import Registry

ATTACKS: Registry[Attack] = Registry("attack")

_FAMILIES = (
    "analytic_vit",
    "april_mjp",
    "inverting",
    "labels",
    "presence",
    "span",
    "text_opt",
    "adaptive",
    "features",
    "span_mjp",
    "span_robust",
    "inverting_fedavg",
    "head_embedding",
    "multiround",
)


def _load_builtin() -> None:
    for mod in _FAMILIES:
        try:
            importlib.import_module(f"veil.attacks.{mod}")
        except ModuleNotFoundError as e:
            if e.name != f"veil.attacks.{mod}":
                raise


def create_attack(name: str, **settings: Any) -> Attack:
    _load_builtin()
    return ATTACKS.create(name, **settings)


def list_attacks() -> list[str]:
    _load_builtin()
    return ATTACKS.names()


__all__ = [
    "ATTACKS",
    "Attack",
    "Knowledge",
    "LocalTraining",
    "Observation",
    "Reconstruction",
    "create_attack",
    "list_attacks",
    "observe",
]
