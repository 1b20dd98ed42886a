"""Attack registry: `create_attack(name, **settings)` / `list_attacks()`; one family per file,
each registering into `veil.registry.ATTACKS` (which lists the family modules and imports them on
its first lookup).

The threat-model types (`Attack`, `Observation`, `Knowledge`, ...) are loaded on first use (PEP
562 `__getattr__`): they import torch, and `veil attack` checks its options
(`veil.attacks.options`, this package's torch-free part) before torch loads.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from veil.attacks.options import Options, describe, specs
from veil.errors import VeilError
from veil.registry import ATTACKS
from veil.schema import Option

if TYPE_CHECKING:
    from veil.attacks.base import Attack

_BASE = ("Attack", "Knowledge", "LocalTraining", "Observation", "Reconstruction", "observe")


def create_attack(name: str, **settings: Any) -> Attack:
    return ATTACKS.create(name, **settings)


def attack_options(name: str) -> dict[str, Option]:
    """The options attack `name` declares (type, default, help), for `veil list --details NAME`."""
    return describe(options_type(name))


def options_type(name: str) -> type[Options]:
    """The options dataclass attack `name` declares."""
    return getattr(ATTACKS.factory(name), "options_type", Options)


def attack_checks(name: str) -> dict[str, Any]:
    """What the catalog keeps so that `veil attack` checks options without importing the attacks
    (`veil.attacks.options.check_listed`): each option's type spec, the inner-attack option, and
    the largest private batch the attack models with why (`Attack.max_batch`; None: any)."""
    cls = options_type(name)
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    most = getattr(ATTACKS.factory(name), "max_batch", None)
    return {
        "spec": specs(cls),
        "inner": None if cls.inner is None else [cls.inner, defaults[cls.inner]],
        "max_batch": None if most is None else list(most),
    }


def check_attack(entry: dict[str, Any], where: str = "") -> None:
    """Build the attack of a `{name: ..., <options>}` entry (cheap: no model is touched) so that an
    unknown name, an unknown option or a wrong type fails here, in one line prefixed by `where`,
    before any training."""
    try:
        create_attack(entry["name"], **{k: v for k, v in entry.items() if k != "name"})
    except VeilError as e:
        raise VeilError(f"{where}: {e}" if where else str(e)) from None


def list_attacks() -> list[str]:
    return ATTACKS.names()


def attacks_observing(view: str) -> list[str]:
    """The registered attacks that observe `view` (a word of `veil.attacks.base.OBSERVES`)."""
    return [n for n in ATTACKS.names() if view in getattr(ATTACKS.factory(n), "observes", ())]


def __getattr__(name: str) -> Any:
    if name in _BASE:
        from veil.attacks import base  # torch: see the module docstring

        return getattr(base, name)
    raise AttributeError(f"module 'veil.attacks' has no attribute {name!r}")


__all__ = [
    "ATTACKS",
    "Attack",
    "Knowledge",
    "LocalTraining",
    "Observation",
    "Reconstruction",
    "attack_checks",
    "attack_options",
    "attacks_observing",
    "check_attack",
    "options_type",
    "create_attack",
    "list_attacks",
    "observe",
]
