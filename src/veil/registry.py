"""veil's registries (models, data sets, defenses, attacks, the audit's protocols) and the one rule that fills them.

The rule: a registry names the modules that register into it, and imports them on its first
lookup (`names`, `create`, `factory`, `options`, `in`). Importing `veil.registry` therefore
costs nothing, a component is registered by the module that defines it (``@DEFENSES.register``),
and no package has to import its members for their side effects. The composition root
(`veil.build`) and the config checks (`veil.config`) sit in veil's core yet reach every
component through these registries, by name, without importing the packages above them
(docs/architecture.md).

A module listed here that fails to import is an error, never a silently shorter list. A new
component goes into a module already listed, or its module is added to the list below.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from veil.errors import VeilError
from veil.schema import Option, options_of, unknown_option

if TYPE_CHECKING:  # the kinds, for type checkers only: the registries import nothing above the core
    from veil.attacks.base import Attack
    from veil.data.splits import DataSplits
    from veil.defenses.base import Defense
    from veil.models.base import VeilModel

T = TypeVar("T")


class Registry(Generic[T]):
    """Maps names to factories of one kind of object, filled lazily from a list of modules."""

    def __init__(self, kind: str, modules: Sequence[str] = (), checked_by_component: bool = False) -> None:
        self.kind = kind
        self.modules = tuple(modules)
        self.checked_by_component = checked_by_component
        self._factories: dict[str, Callable[..., T]] = {}
        self._help: dict[str, str] = {}
        self._loaded = False

    def register(self, name: str, help: str = "") -> Callable[[Callable[..., T]], Callable[..., T]]:
        """Decorator: register `factory` under `name`; `help` defaults to its docstring's first line.

        A class with a ``name`` attribute (attacks, defenses) that does not set its own gets `name`.
        A factory may carry ``options`` (a set of accepted keys) and ``schema()`` (their
        `Option`s) when its signature does not tell them (a model preset's config dataclass)."""

        def wrap(factory: Callable[..., T]) -> Callable[..., T]:
            if name in self._factories:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            if isinstance(factory, type) and hasattr(factory, "name") and "name" not in vars(factory):
                factory.name = name  # an attack's or defense's name is the one it is registered under
            self._factories[name] = factory
            doc = (factory.__doc__ or "").strip().splitlines()
            self._help[name] = help or (doc[0] if doc else "")
            return factory

        return wrap

    def load(self) -> None:
        """Import the listed modules once (each registers its components)."""
        if self._loaded:
            return
        self._loaded = True  # set first: a listed module may look names up while it registers
        for module in self.modules:
            importlib.import_module(module)

    def factory(self, name: str) -> Callable[..., T]:
        """The factory registered as `name`; an unknown name is one line listing the known ones."""
        self.load()
        if name not in self._factories:
            raise VeilError(f"unknown {self.kind} {name!r}; choose one of: {', '.join(self.names())}")
        return self._factories[name]

    def create(self, name: str, **kwargs: Any) -> T:
        """Build `name` from keyword options. A key it does not take is one line naming the nearest
        and the allowed ones, checked here before it is built (models, data sets, defenses), or by
        the component itself where it checks types too (`checked_by_component`: attacks)."""
        factory = self.factory(name)
        if not self.checked_by_component and not _takes_any(factory):
            keys = self.keys(name)
            unknown = sorted(set(kwargs) - keys)
            if unknown:
                raise unknown_option(f"{self.kind} {name}", unknown[0], keys)
        return factory(**kwargs)

    def options(self, name: str) -> dict[str, Option]:
        """The keyword options `name` takes (type, default, help): its factory's ``schema()`` when
        it has one, else read from the factory's signature."""
        factory = self.factory(name)
        schema = getattr(factory, "schema", None)
        return schema() if callable(schema) else options_of(factory)

    def keys(self, name: str) -> set[str]:
        """The option names `name` accepts (a factory's ``options`` when it declares them)."""
        declared = getattr(self.factory(name), "options", None)
        return set(declared) if isinstance(declared, (set, frozenset)) else set(self.options(name))

    def names(self) -> list[str]:
        self.load()
        return sorted(self._factories)

    def describe(self) -> dict[str, str]:
        """Every name with its one-line help."""
        return {n: self._help[n] for n in self.names()}

    def __contains__(self, name: object) -> bool:
        self.load()
        return name in self._factories


def _takes_any(factory: Callable[..., Any]) -> bool:
    """Whether `factory` takes keywords its registry cannot list (``**kwargs`` with no declared
    ``options`` or ``schema``): then the factory checks them itself."""
    if getattr(factory, "options", None) is not None or callable(getattr(factory, "schema", None)):
        return False
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(p.kind is p.VAR_KEYWORD for p in params)


#: the registries and the modules that fill them
MODELS: Registry[VeilModel] = Registry(
    "model",
    modules=(
        "veil.models",
        "veil.models.hf",
        "veil.models.hf_path",
        "veil.models.multiple_choice",
        "veil.models.vit_seg",
    ),
)
DATASETS: Registry[DataSplits] = Registry(
    "dataset",
    modules=(
        "veil.data.images",
        "veil.data.text",
        "veil.data.multiple_choice",
        "veil.data.segmentation",
        "veil.data.heldout",
    ),
)
DEFENSES: Registry[Defense] = Registry(
    "defense",
    modules=(
        "veil.defenses",
        "veil.defenses.mjp",
        "veil.defenses.aegis",
        "veil.defenses.baselines",
        "veil.defenses.dpsgd",
        "veil.defenses.permutation",
    ),
)
ATTACKS: Registry[Attack] = Registry(
    "attack",
    modules=tuple(
        f"veil.attacks.{m}"
        for m in (
            "analytic_vit",
            "april_mjp",
            "inverting",
            "labels",
            "presence",
            "span",  # the package registers span, span-mjp and span-robust
            "text_opt",
            "adaptive",
            "features",
            "inverting_fedavg",
            "head_embedding",
            "multiround",
            "sparse_rows",
        )
    ),
    checked_by_component=True,  # `veil.attacks.options.check`: keys and value types, in the attack's own words
)
#: model tuners a run applies after building its model (`train.lora`: `veil.models.lora`)
TUNERS: Registry[Any] = Registry("tuner", modules=("veil.models.lora",))
#: the protocols the audit engine hands a non-single-step task to (`veil.experiments.audit`): each
#: registers an object with validate_task(task, s) and run_task(task, s, out, progress), which
#: returns the task's data; `veil.report.protocols` renders it
PROTOCOLS: Registry[Any] = Registry(
    "protocol", modules=("veil.federated.fedavg.audit", "veil.federated.split.audit", "veil.experiments.dp_audit")
)
