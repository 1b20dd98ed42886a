"""Declared attack options: each attack names its settings in a frozen dataclass (field, type,
default, one-line help), and a setting is checked against it when the attack is built.

Why: an attack that stores whatever keyword it is given and reads it with a default turns a typo
(`iteratons=5`) into a silent run of the default. Here an unknown key or a value of the wrong type is one
`VeilError` line naming the key and the allowed options (with the closest name when there is
one). `veil attack`, scenario validation and `veil list --details NAME` read the same declaration.

    @dataclass(frozen=True)
    class IGOptions(Options):
        iterations: int = option(800, "optimiser steps per restart")
        layers: Literal["input", "all"] = option("input", "which exported gradients are compared")

Each field's type is turned into a JSON-able *spec* ("int", "float", "bool", "str", "none",
"any", {"one_of": [...]}, {"any_of": [spec, ...]}, {"list_of": spec}); values are checked against
the spec, so the catalog (`veil.commands.catalog`, no torch) can carry the specs and `veil attack`
checks its `attack.KEY=VALUE` words before it imports torch. An int, or a string such as YAML's
'1e-4', is accepted for a float and converted; a list for a tuple. This module imports no torch.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, TypeVar, Union

from veil.errors import VeilError
from veil.schema import Option, unknown_option

O = TypeVar("O", bound="Options")  # noqa: E741 - a type variable
Spec = Any  # str | dict: see the module docstring

#: where the attack phase may run (`attack.device`; `veil.attacks.harness.attack_device`): auto
#: takes CUDA when present, else the CPU
DEVICES = ("auto", "cpu", "cuda")


def check_device(value: Any) -> str:
    """`value` if it names an attack device (`DEVICES`), else a one-line error; no torch needed."""
    if value not in DEVICES:
        raise VeilError(f"attack.device must be one of {', '.join(DEVICES)}, got {value!r}")
    return str(value)


@dataclass(frozen=True)
class Options:
    """An attack's declared options (the base declares none)."""

    #: the option that names an inner attack whose options this attack also takes (multi-round)
    inner: ClassVar[str | None] = None


def option(default: Any, help: str) -> Any:
    """A declared option: its default and one help line (shown by `veil list --details NAME`)."""
    return field(default=default, metadata={"help": help})


def spec_of(tp: Any) -> Spec:
    """The JSON-able spec of a type annotation."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return {"any_of": [spec_of(a) for a in typing.get_args(tp)]}
    if origin is Literal:
        return {"one_of": list(typing.get_args(tp))}
    if origin in (tuple, list):
        args = [a for a in typing.get_args(tp) if a is not Ellipsis]
        return {"list_of": spec_of(args[0]) if args else "any"}
    names = {bool: "bool", int: "int", float: "float", str: "str", type(None): "none"}
    return names.get(tp, "any")


def specs(cls: type[Options]) -> dict[str, Spec]:
    """{option: spec} of an options dataclass, in declaration order."""
    hints = typing.get_type_hints(cls)
    return {f.name: spec_of(hints[f.name]) for f in dataclasses.fields(cls)}


def fit(spec: Spec, value: Any) -> tuple[bool, Any]:
    """(does `value` fit `spec`, the value converted to it)."""
    if isinstance(spec, dict) and "any_of" in spec:
        for s in sorted(spec["any_of"], key=lambda s: s == "float"):  # exact kinds before float's leniency
            ok, out = fit(s, value)
            if ok:
                return True, out
        return False, value
    if isinstance(spec, dict) and "one_of" in spec:
        return any(value == a and type(value) is type(a) for a in spec["one_of"]), value
    if isinstance(spec, dict) and "list_of" in spec:
        if not isinstance(value, (list, tuple)):
            return False, value
        parts = [fit(spec["list_of"], v) for v in value]
        return all(ok for ok, _ in parts), tuple(v for _, v in parts)
    if spec == "float":
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return True, float(value)
        if isinstance(value, str):
            try:
                return True, float(value)
            except ValueError:
                return False, value
        return False, value
    checks = {
        "bool": lambda v: isinstance(v, bool),
        "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "str": lambda v: isinstance(v, str),
        "none": lambda v: v is None,
    }
    return (checks[spec](value) if spec in checks else True), value


def type_name(spec: Spec) -> str:
    if isinstance(spec, dict) and "any_of" in spec:
        return " or ".join(type_name(s) for s in spec["any_of"])
    if isinstance(spec, dict) and "one_of" in spec:
        return "one of " + ", ".join(repr(a) for a in spec["one_of"])
    if isinstance(spec, dict) and "list_of" in spec:
        return f"a list of {type_name(spec['list_of'])}"
    return str(spec)


def check(who: str, declared: dict[str, Spec], settings: dict[str, Any]) -> dict[str, Any]:
    """`settings` converted to the declared specs; one `VeilError` line on an unknown key or a
    value of the wrong type, naming the key and listing the allowed options."""
    allowed = ", ".join(sorted(declared)) if declared else "none"  # sorted: the catalog keeps no order
    out = {}
    for key, value in settings.items():
        if key not in declared:
            raise unknown_option(who, key, declared)
        ok, out[key] = fit(declared[key], value)
        if not ok:
            raise VeilError(
                f"{who}: option {key!r} must be {type_name(declared[key])}, got {value!r}; options: {allowed}"
            )
    return out


def parse_options(who: str, cls: type[O], settings: dict[str, Any]) -> O:
    """`cls(**settings)` after `check`."""
    return cls(**check(who, specs(cls), settings))


def split_inner(cls: type[Options], settings: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(this attack's own settings, those it passes to its inner attack) for an attack whose
    options name an inner one (`Options.inner`); everything is its own otherwise."""
    if cls.inner is None:
        return dict(settings), {}
    own = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in settings.items() if k in own}, {k: v for k, v in settings.items() if k not in own}


def describe(cls: type[Options]) -> dict[str, Option]:
    """The declared options as `veil.schema.Option` rows (name, type, default, help) for `veil list`."""
    hints = typing.get_type_hints(cls)
    return {
        f.name: Option(f.name, hints[f.name], f.default, str(f.metadata.get("help", "")))
        for f in dataclasses.fields(cls)
    }


def check_listed(name: str, settings: dict[str, Any], attacks: dict[str, Any]) -> None:
    """The same check from a catalog's attack entries (`veil.commands.catalog`: `spec`, `inner`),
    without importing the attacks: `veil attack` runs it before it loads torch."""
    if name not in attacks:
        raise VeilError(f"unknown attack {name!r}; choose one of: {', '.join(sorted(attacks))}")
    entry = attacks[name]
    inner = entry.get("inner")  # None, or [the option naming the inner attack, its default]
    own = {k: v for k, v in settings.items() if inner is None or k in entry["spec"]}
    check(name, entry["spec"], own)
    if inner is not None:
        key, default = inner
        target = attacks[str(own.get(key, default))]["spec"]
        check(name, {**entry["spec"], **target}, settings)


__all__ = ["Options", "check", "check_listed", "describe", "option", "parse_options", "spec_of", "specs", "split_inner"]
