"""Typed run configs: a YAML file plus `key=value` overrides, validated before anything runs.

A config has four sections; `model`, `data` and each `defense` entry name a registered object
and carry that object's own options, checked against its signature:

    model: {name: vit-digits, dim: 64}
    data: {name: digits, test_fraction: 0.2}
    defense: [{name: mjp, gamma: 0.1}]      # or a single mapping, or a name
    train: {epochs: 30, batch_size: 64, lr: 0.002, ...}

Overrides: `model=minilm`, `train.epochs=3`, `defense=mjp`, `defense.gamma=0.1`, or a bare
`gamma=0.1` when exactly one section knows the key. Every bad key, type or name is a one-line
`VeilError` naming the key and what is allowed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from veil.errors import VeilError
from veil.registry import DATASETS, DEFENSES, MODELS, TUNERS, Registry
from veil.schema import check_value


@dataclass
class TrainConfig:
    epochs: int = 10
    batch_size: int = 32
    lr: float = 1e-3
    weight_decay: float = 0.05
    warmup: float = 0.1  # fraction of all steps spent warming up
    clip: float = 1.0  # max gradient norm; 0 disables
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda
    threads: int = 0  # CPU threads for torch; 0 keeps torch's default (small models often run faster on 1)
    eval_batch_size: int = 256
    max_steps: int = 0  # 0: epochs decide
    label_smoothing: float = 0.0  # classification cross-entropy smoothing, in [0, 1)
    frozen_features: bool = (
        False  # only the classifier trains: compute the frozen encoder's output once (veil.training.frozen)
    )
    #: LoRA fine-tuning {r, alpha, dropout, targets, head} (veil.models.lora); {} trains the whole model
    lora: dict[str, Any] = field(default_factory=dict)


@dataclass
class RunConfig:
    model: dict[str, Any] = field(default_factory=lambda: {"name": "vit-digits"})
    data: dict[str, Any] = field(default_factory=lambda: {"name": "digits"})
    defense: list[dict[str, Any]] = field(default_factory=list)
    train: TrainConfig = field(default_factory=TrainConfig)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": dict(self.model),
            "data": dict(self.data),
            "defense": [dict(d) for d in self.defense],
            "train": dataclasses.asdict(self.train),
        }


SECTIONS = ("model", "data", "defense", "train")


# ---- option discovery: what each named object accepts (through the registries, by name) ------
_REGISTRIES: dict[str, Registry[Any]] = {"model": MODELS, "data": DATASETS, "defense": DEFENSES}


_TRAIN_FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}


# ---- parsing -----------------------------------------------------------------------------------
def parse_value(text: str) -> Any:
    """`key=value` values are YAML scalars: 3 -> int, 0.1 -> float, true -> bool, [a, b] -> list."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def _named(section: str, value: Any) -> dict[str, Any]:
    if isinstance(value, str):
        return {"name": value}
    if isinstance(value, dict) and isinstance(value.get("name"), str):
        return dict(value)
    raise VeilError(f"config section '{section}' must be a name or a mapping with a 'name' key")


def _defenses(value: Any) -> list[dict[str, Any]]:
    if value is None or value == "none":
        return []
    items = value if isinstance(value, list) else [value]
    out = [_named("defense", v) for v in items]
    return [d for d in out if d["name"] != "none"]


#: train keys with a range: (test, what the value must be)
_TRAIN_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "epochs": (lambda v: v >= 1, "an integer >= 1"),
    "batch_size": (lambda v: v >= 1, "an integer >= 1"),
    "eval_batch_size": (lambda v: v >= 1, "an integer >= 1"),
    "lr": (lambda v: v > 0, "a number > 0"),
    "weight_decay": (lambda v: v >= 0, "a number >= 0"),
    "warmup": (lambda v: 0 <= v <= 1, "a fraction of all steps in [0, 1]"),
    "clip": (lambda v: v >= 0, "a max gradient norm >= 0 (0 disables clipping)"),
    "threads": (lambda v: v >= 0, "an integer >= 0 (0 keeps torch's default)"),
    "max_steps": (lambda v: v >= 0, "an integer >= 0 (0: epochs decide)"),
    "label_smoothing": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "device": (lambda v: v in ("auto", "cpu", "cuda"), "auto, cpu or cuda"),
}


def coerce_section(
    cls: type[Any],
    raw: Any,
    section: str,
    rules: dict[str, tuple[Callable[[Any], bool], str]] | None = None,
) -> Any:
    """Build config dataclass `cls` from the mapping of config section `section`: known keys only,
    each value of its default's type (an int is taken as a float; a single name or mapping as a
    one-item list), and in the range `rules` gives (key: (test, what the value must be)). Every
    bad key or value is a one-line `VeilError` naming `section.key` and what is allowed. Shared
    by `train` and the extra sections (`federated`, `split`)."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise VeilError(f"config section '{section}' must be a mapping")
    fields = {f.name for f in dataclasses.fields(cls)}
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
        test, what = (rules or {}).get(key, (lambda v: True, ""))
        if not test(val):
            raise VeilError(f"config key '{section}.{key}' must be {what}, got {val!r}")
        values[key] = val
    return cls(**values)


def _check_options(section: str, entry: dict[str, Any]) -> None:
    """The section's schema: the named object's keys, and each value's type (its builder's signature)."""
    allowed = _REGISTRIES[section].keys(entry["name"])
    for key in entry:
        if key != "name" and key not in allowed:
            raise VeilError(
                f"unknown config key '{section}.{key}' for {section} {entry['name']!r}; allowed: {', '.join(sorted(allowed)) or '(none)'}"
            )
    schema = _REGISTRIES[section].options(entry["name"])
    for key, value in entry.items():
        if key in schema:
            check_value(f"{section}.{key}", schema[key], value)


def _check_lora(lora: dict[str, Any]) -> None:
    """`train.lora`'s keys and plain types (its tuner's signature); ranges: `veil.models.lora`."""
    if not lora:
        return
    schema = {k: o for k, o in TUNERS.options("lora").items() if k not in ("model", "base")}
    for key, value in lora.items():
        if key not in schema:
            raise VeilError(f"unknown config key 'train.lora.{key}'; allowed: {', '.join(sorted(schema))}")
        check_value(f"train.lora.{key}", schema[key], value)


def from_dict(raw: dict[str, Any]) -> RunConfig:
    """Validate a raw mapping into a RunConfig (names, keys and train types)."""
    if not isinstance(raw, dict):
        raise VeilError("a config must be a YAML mapping with sections: " + ", ".join(SECTIONS))
    unknown = sorted(set(raw) - set(SECTIONS))
    if unknown:
        raise VeilError(f"unknown config section '{unknown[0]}'; allowed: {', '.join(SECTIONS)}")
    cfg = RunConfig(
        model=_named("model", raw.get("model", "vit-digits")),
        data=_named("data", raw.get("data", "digits")),
        defense=_defenses(raw.get("defense")),
        train=coerce_section(TrainConfig, raw.get("train"), "train", _TRAIN_RULES),
    )
    _check_options("model", cfg.model)
    _check_options("data", cfg.data)
    _check_lora(cfg.train.lora)
    for d in cfg.defense:
        _check_options("defense", d)
    return cfg


#: what a file of each kind must hold, for the one-line error of an empty or non-mapping file
NEEDS = {
    "config file": "a config needs at least a model and a data set, e.g. `model: vit-digits` and "
    "`data: digits`, with optional sections defense and train (examples in configs/)",
    "scenario": "a scenario must be a mapping with name, seeds and tasks (a list; each task with run, "
    "defenses and attacks), e.g. veil's embedded quickstart (`veil audit` with no scenario)",
}


def read_yaml(path: str | Path, what: str = "config file") -> dict[str, Any]:
    """The mapping a YAML `what` (config file | scenario) holds; a missing, non-UTF-8, invalid,
    empty or non-mapping file is one line naming it and what it must hold."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.yaml"
    if not p.is_file():
        raise VeilError(f"{what} '{path}' does not exist")
    try:
        text = p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise VeilError(
            f"{what} '{path}' is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}); save it as UTF-8"
        ) from None
    except OSError as e:
        raise VeilError(f"cannot read {what} '{path}': {e.strerror}") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise VeilError(f"{what} '{path}' is not valid YAML{where}") from None
    if raw is None:
        raise VeilError(f"{what} '{path}' is empty; {NEEDS.get(what, 'it must hold a YAML mapping')}")
    if not isinstance(raw, dict):
        kind = "a list" if isinstance(raw, list) else f"the {type(raw).__name__} {raw!r}"[:60]
        if what == "config file":
            raise VeilError(
                f"config file '{path}' must hold a mapping with sections: {', '.join(SECTIONS)}; got {kind}"
            )
        raise VeilError(f"{what} '{path}' holds {kind}; {NEEDS.get(what, 'it must hold a YAML mapping')}")
    if what == "config file" and not Path(path).is_dir():
        resolve_paths(raw, p.resolve().parent)
    return raw


def resolve_paths(raw: dict[str, Any], base: Path) -> None:
    """A relative ``data.path`` (and a ``model.path`` that exists there) in a config file means a
    file beside the config: made absolute against `base`, the config's folder, in place (the run
    folder's resolved config then names the file wherever the run is read from)."""
    for section, always in (("data", True), ("model", False)):
        entry = raw.get(section)
        path = entry.get("path") if isinstance(entry, dict) else None
        if not isinstance(path, str) or not path or Path(path).expanduser().is_absolute():
            continue
        target = base / path
        if always or target.exists():
            entry["path"] = str(target)


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `key=value` strings to a raw config mapping (before validation)."""
    raw = {k: v for k, v in raw.items()}
    for item in overrides:
        if "=" not in item:
            raise VeilError(f"override '{item}' is not of the form key=value")
        key, text = item.split("=", 1)
        _set(raw, key.strip(), parse_value(text))
    return raw


def _set(raw: dict[str, Any], key: str, value: Any) -> None:
    if key in ("model", "data"):
        raw[key] = value if isinstance(value, dict) else {"name": value}
        return
    if key == "defense":
        raw[key] = value
        return
    if "." not in key:
        key = _resolve_bare(raw, key)
    section, _, sub = key.partition(".")
    if section not in SECTIONS:
        raise VeilError(f"unknown config key '{key}'; sections are: {', '.join(SECTIONS)}")
    if section == "defense":
        ds = _defenses(raw.get("defense"))
        if len(ds) != 1:
            raise VeilError(
                f"override '{key}' needs exactly one defense in the config (found {len(ds)}); set defense=NAME first"
            )
        ds[0][sub] = value
        raw["defense"] = ds
        return
    target = raw.get(section)
    target = {"name": target} if isinstance(target, str) else dict(target or {})
    if section in ("model", "data") and "name" not in target:
        target["name"] = RunConfig().__getattribute__(section)["name"]
    head, _, rest = sub.partition(".")
    if section == "train" and rest:  # a nested train key: train.lora.r=8
        inner = target.get(head)
        target[head] = {**(inner if isinstance(inner, dict) else {}), rest: value}
    else:
        target[sub] = value
    raw[section] = target


def _resolve_bare(raw: dict[str, Any], key: str) -> str:
    """Find the one section whose object accepts `key` (e.g. gamma -> defense.gamma)."""
    owners = []
    if key in _TRAIN_FIELDS:
        owners.append("train")
    for section in ("model", "data"):
        entry = raw.get(section, RunConfig().__getattribute__(section))
        name = entry if isinstance(entry, str) else (entry or {}).get("name")
        if name and key in _REGISTRIES[section].keys(name):
            owners.append(section)
    ds = _defenses(raw.get("defense"))
    if len(ds) == 1 and key in DEFENSES.keys(ds[0]["name"]):
        owners.append("defense")
    if len(owners) > 1:
        raise VeilError(
            f"config key '{key}' is ambiguous (it fits {', '.join(owners)}); write it as section.key, e.g. {owners[0]}.{key}"
        )
    if not owners:
        raise VeilError(f"unknown config key '{key}' (no section accepts it){_who_takes(key)}")
    return f"{owners[0]}.{key}"


def _who_takes(key: str) -> str:
    """Where a bare key would fit: the registered defenses (or models, data sets) that take it."""
    for section in ("defense", "model", "data"):
        reg = _REGISTRIES[section]
        owners = [n for n in reg.names() if key in reg.keys(n)]
        if owners:
            shown = owners if section == "defense" else owners[:4]
            return f"; {section} {' / '.join(shown)} takes it: {section}={owners[0]} {section}.{key}=VALUE"
    return "; see `veil list --details NAME` for a component's options"


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Read a YAML config (or a run folder's resolved config) and apply overrides."""
    raw = read_yaml(path) if path is not None else {}
    return from_dict(apply_overrides(raw, overrides or []))


def dump_config(cfg: RunConfig) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)


def same_config(text: str, cfg: RunConfig) -> bool:
    """Whether a run folder's saved config means `cfg` (keys added later with their defaults
    compare equal, so older run folders stay reusable)."""
    try:
        return dump_config(from_dict(yaml.safe_load(text))) == dump_config(cfg)
    except (VeilError, yaml.YAMLError):
        return False
