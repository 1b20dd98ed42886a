"""The extra sections of a run config (`federated:`, `split:`) beside model / data / defense /
train: separating them from what `veil.config` reads, `section.key=value` overrides, the choice
check both sections share (keys and types: `veil.config.coerce_section`; every bad key or value is
a one-line `VeilError`), and what FedAvg's `Spec` and split learning's `SplitSpec` share: reading
a config with its overrides (`read_sections`) and the resolved text every message carries
(`SpecText`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from veil.config import apply_overrides, parse_value, read_yaml
from veil.errors import VeilError


class SpecText:
    """The resolved run spec as YAML (`raw`): what a run folder's config.yaml and every message hold."""

    raw: dict[str, Any]

    def text(self) -> str:
        return yaml.safe_dump(self.raw, sort_keys=False)


def read_sections(path: str | Path | None, overrides: list[str] | None = None) -> dict[str, Any]:
    """A YAML config (or a run folder's) with `key=value` overrides applied: the base sections
    through `veil.config`, `federated.` / `split.` ones into their sections (not yet validated)."""
    raw = read_yaml(path) if path is not None else {}
    base, extra = split_sections(raw)
    extra, rest = apply_extra_overrides(extra, overrides or [])
    return {**apply_overrides(base, rest), **extra}


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
