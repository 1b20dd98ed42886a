"""Options of a builder (a function, a class or a config dataclass), read from its signature:
name, type, default and a help line from its docstring. The config checks values against these
types (one line per bad value); `veil list --details NAME` prints them.

Only plain types are checked (int, float, bool, str, their unions with None, Literal); an option
of any other type is passed through to its builder, which checks it.
"""

from __future__ import annotations

import difflib
import inspect
import re
import types
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal, Union

from veil.errors import VeilError

REQUIRED = "(required)"
_SCALARS = (bool, int, float, str)


@dataclass(frozen=True)
class Option:
    name: str
    type: Any  # the annotation (a type, a union, a Literal) or None when unannotated
    default: Any
    help: str = ""

    def type_name(self) -> str:
        return _type_name(self.type)


def options_of(builder: Callable[..., Any], defaults: dict[str, Any] | None = None) -> dict[str, Option]:
    """The keyword options `builder` takes; `defaults` override the signature's (a preset's)."""
    target = builder.__init__ if inspect.isclass(builder) and not _is_dataclass(builder) else builder
    try:
        sig = inspect.signature(builder)
    except (TypeError, ValueError):
        return {}
    try:
        hints = typing.get_type_hints(builder if _is_dataclass(builder) else target)
    except Exception:  # an annotation that does not evaluate here: leave the types unchecked
        hints = {}
    # a dataclass's help lines: its own docstring's over those of the dataclasses it extends
    docs = (
        [c.__doc__ for c in reversed(builder.__mro__) if _is_dataclass(c)]
        if _is_dataclass(builder)
        else [inspect.getdoc(builder)]
    )
    helps = {k: v for doc in docs for k, v in doc_help(inspect.cleandoc(doc or "")).items()}
    out: dict[str, Option] = {}
    for name, p in sig.parameters.items():
        if p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) or name == "self":
            continue
        default = REQUIRED if p.default is p.empty else p.default
        if defaults and name in defaults:
            default = defaults[name]
        out[name] = Option(name, hints.get(name), default, helps.get(name, ""))
    return out


def unknown_option(who: str, key: str, allowed: Iterable[str]) -> VeilError:
    """The one line for an option `who` does not take: the nearest allowed name, then all of them."""
    names = sorted(allowed)
    close = difflib.get_close_matches(str(key), names, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return VeilError(f"{who}: unknown option {key!r}{hint}; options: {', '.join(names) or 'none'}")


def _is_dataclass(obj: Any) -> bool:
    return inspect.isclass(obj) and hasattr(obj, "__dataclass_fields__")


def doc_help(doc: str) -> dict[str, str]:
    """`name: text` paragraphs of a docstring (the first sentence of each, which may run over
    several lines) by option name."""
    out: dict[str, str] = {}
    name, text = None, ""
    for line in doc.splitlines() + [""]:
        m = re.match(r"\s*([a-z_][a-z0-9_]*)(?: \([^)]*\))?: (.+)", line)
        if name is not None and (m or not line.strip() or re.search(r"\.(\s|$)", text)):
            out.setdefault(name, re.split(r"(?<=\.)\s", text.strip(), maxsplit=1)[0])
            name = None
        if m:
            name, text = m.group(1), m.group(2)
        elif name is not None:
            text += " " + line.strip()
    return out


def check_value(where: str, opt: Option, value: Any) -> None:
    """A one-line `VeilError` when `value` does not fit the option's plain type."""
    if opt.type is None or _fits(opt.type, value):
        return
    raise VeilError(f"config key '{where}' must be {_type_name(opt.type)}, got {value!r}")


def _fits(tp: Any, value: Any) -> bool:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return any(_fits(a, value) for a in typing.get_args(tp))
    if origin is Literal:
        return value in typing.get_args(tp)
    if tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    return True  # not a plain type: the builder checks it


def _type_name(tp: Any) -> str:
    if tp is None:
        return "any"
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return " or ".join("none" if a is type(None) else _type_name(a) for a in typing.get_args(tp))
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if tp in _SCALARS:
        return tp.__name__
    return str(tp).replace("typing.", "")
