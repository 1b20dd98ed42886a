"""The extra sections of a run config (`federated:`, `split:`) beside model / data / defense /
train: separating them from what `veil.config` reads, `section.key=value` overrides, and the
key / type / choice checks both sections share (every bad key or value is a one-line `VeilError`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from veil.errors import VeilError


def coerce(cls: type, raw: Any, section: str) -> Any:
    """Build dataclass `cls` from a mapping, checking keys and scalar types (ints accepted as floats)."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise VeilError(f"config section '{section}' must be a mapping")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    default = cls()
    values: dict[str, Any] = {}
    for key, val in raw.items():
        if key not in fields:
            raise VeilError(f"unknown config key '{section}.{key}'; allowed: {', '.join(sorted(fields))}")
        want = type(getattr(default, key))
        if want is float and isinstance(val, int) and not isinstance(val, bool):
            val = float(val)
        if want is list and isinstance(val, (str, dict)):
            val = [val]
        if not isinstance(val, want) or (want is int and isinstance(val, bool)):
            raise VeilError(f"config key '{section}.{key}' must be {want.__name__}, got {val!r}")
        values[key] = val
    return cls(**values)


def check_choices(cfg: Any, section: str, choices: dict[str, tuple[str, ...]]) -> None:
    """Every `choices` key of `cfg` holds one of its allowed values."""
    for key, allowed in choices.items():
        if getattr(cfg, key) not in allowed:
            raise VeilError(f"{section}.{key} must be one of {', '.join(allowed)}, got {getattr(cfg, key)!r}")


EXTRA_SECTIONS = ("federated", "split")


def split_sections(raw: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the model/data/defense/train mapping `veil.config.from_dict` reads, the extra sections)."""
    base = {k: v for k, v in raw.items() if k not in EXTRA_SECTIONS}
    extra = {k: raw[k] for k in EXTRA_SECTIONS if k in raw}
    return base, extra


def apply_extra_overrides(extra: dict[str, Any], overrides: list[str]) -> tuple[dict[str, Any], list[str]]:
    """Take `federated.x=v` / `split.x=v` overrides out of the list; the rest go to `veil.config`."""
    from veil.config import parse_value

    extra = {k: dict(v or {}) for k, v in extra.items()}
    rest = []
    for item in overrides:
        key = item.split("=", 1)[0].strip()
        section, _, sub = key.partition(".")
        if section in EXTRA_SECTIONS and sub and "=" in item:
            extra.setdefault(section, {})[sub] = parse_value(item.split("=", 1)[1])
        else:
            rest.append(item)
    return extra, rest
