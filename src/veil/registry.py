"""A small generic registry: `register`, `create`, `names` — one instance per kind.

Models, defenses and attacks each own one `Registry`; `veil list` shows all of them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

from veil.errors import VeilError

T = TypeVar("T")


class Registry(Generic[T]):
    """Maps names to factories of one kind of object."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._factories: dict[str, Callable[..., T]] = {}
        self._help: dict[str, str] = {}

    def register(self, name: str, help: str = "") -> Callable[[Callable[..., T]], Callable[..., T]]:
        def wrap(factory: Callable[..., T]) -> Callable[..., T]:
            if name in self._factories:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._factories[name] = factory
            doc = (factory.__doc__ or "").strip().splitlines()
            self._help[name] = help or (doc[0] if doc else "")
            return factory

        return wrap

    def create(self, name: str, **kwargs: Any) -> T:
        if name not in self._factories:
            raise VeilError(f"unknown {self.kind} {name!r}; choose one of: {', '.join(self.names())}")
        return self._factories[name](**kwargs)

    def names(self) -> list[str]:
        return sorted(self._factories)

    def describe(self) -> dict[str, str]:
        return {n: self._help[n] for n in self.names()}

    def __contains__(self, name: object) -> bool:
        return name in self._factories
