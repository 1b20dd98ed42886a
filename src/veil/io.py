"""Files a run folder holds, written so an interruption never leaves half a file behind.

Every writer goes through a temporary name and `os.replace`, which is atomic on POSIX: a reader
sees the old file or the new one, never a mix. A cached result (and each checkpoint) also gets a
`NAME.sha256` beside it, recorded at write time; a file whose bytes no longer match it is never
silently reused (`intact`, `verify`). The event log (`metrics.jsonl`) is one JSON object a line,
appended per epoch or round and cut back to the checkpoint on resume (`truncate_events`).
Tensors and model weights are safetensors files (never pickle), published with their hash.
A checkpoint is several files that must change together; `staged` writes the new set beside the
old one and `settle` moves it in, so a kill between two files never pairs new weights with an old
`state.json` (or the reverse).

This module sits in veil's core: training, the audit engine, federated runs and the report all
write through it, and it imports nothing of theirs.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file, save_model

from veil.errors import VeilError


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` to `path` through a temporary file and a rename."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# ---- a set of files published as one step ----------------------------------------------------
STAGE = ".next"


@contextmanager
def staged(folder: Path, marker: str = "state.json") -> Iterator[Path]:
    """Where to write a checkpoint whose files must change together: the caller writes every file
    into the yielded `folder/.next/`, `marker` last; on exit `settle` moves the set into `folder`.
    A kill at any point leaves `folder` holding the old set or, after the next `settle`, the new one."""
    settle(folder, marker)  # finish (or drop) what an earlier process left half-moved
    stage = folder / STAGE
    stage.mkdir(parents=True)
    yield stage
    settle(folder, marker)


def settle(folder: Path, marker: str = "state.json") -> None:
    """Complete an interrupted `staged` publish: a staged set whose `marker` was written is whole and
    is moved in (its other files first, `marker` last: moving is redone from where it stopped); a
    set without its `marker` was cut mid-write and is dropped, leaving the previous set untouched.
    Every reader of a staged folder calls this first."""
    stage = folder / STAGE
    if not stage.is_dir():
        return
    if (stage / marker).is_file():
        for f in sorted(stage.iterdir(), key=lambda f: f.name == marker):
            os.replace(f, folder / f.name)
    shutil.rmtree(stage)


# ---- integrity: a SHA-256 recorded at write time, checked on reuse ----------------------------
def sha256_file(path: Path) -> str:
    """The hex SHA-256 of a file's bytes, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def hash_path(path: Path) -> Path:
    """Where the recorded hash of `path` lives: `NAME.sha256` beside it."""
    return path.with_name(path.name + ".sha256")


def publish(tmp: Path, path: Path) -> None:
    """Rename the finished temporary file `tmp` to `path` with its hash beside it (the two renames
    back to back)."""
    side = hash_path(path).with_name(hash_path(path).name + ".tmp")
    side.write_text(sha256_file(tmp) + "\n")
    os.replace(tmp, path)
    os.replace(side, hash_path(path))


def write_checked_text(path: Path, text: str) -> None:
    """`atomic_write_text` plus the SHA-256 that `intact` checks."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    publish(tmp, path)


def intact(path: Path) -> bool:
    """False when `path` is missing or its bytes differ from the hash recorded when it was
    written; True otherwise (a file written before hashes were recorded cannot be checked)."""
    if not path.is_file():
        return False
    side = hash_path(path)
    return not side.is_file() or side.read_text().strip() == sha256_file(path)


def verify(path: Path, remedy: str = "") -> None:
    """A one-line `VeilError` unless `path` is intact."""
    if not intact(path):
        what = (
            "is missing"
            if not path.is_file()
            else "fails its integrity check (its SHA-256 differs from the one recorded when it was written)"
        )
        raise VeilError(f"checkpoint '{path}' {what}{'; ' + remedy if remedy else ''}")


# ---- the event log: metrics.jsonl ---------------------------------------------------------------
def append_events(path: Path, events: Iterable[dict[str, Any]]) -> None:
    """Append each event as one JSON line."""
    with path.open("a") as f:
        for e in events:
            f.write(json.dumps(e) + "\n")


def truncate_events(path: Path, key: str, upto: int) -> None:
    """On resume, drop the events logged after the checkpoint the run continues from: those whose
    `key` (``step`` in training, ``round`` in FedAvg) is past `upto`; an event without it stays."""
    if path.is_file():
        keep = [line for line in path.read_text().splitlines() if line and json.loads(line).get(key, 0) <= upto]
        atomic_write_text(path, "".join(line + "\n" for line in keep))


# ---- tensors and model weights as safetensors (never pickle) ----------------------------------
def save_tensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """A safetensors file of named tensors (an optimiser state), renamed into place with its hash."""
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp))
    publish(tmp, path)


def load_tensors(path: Path, remedy: str = "") -> dict[str, torch.Tensor]:
    """The tensors of a file `save_tensors` wrote; a damaged file is a one-line `VeilError`."""
    verify(path, remedy)
    try:
        return load_file(str(path))
    except (SafetensorError, OSError):
        raise VeilError(
            f"checkpoint '{path}' is not a readable safetensors file (truncated or damaged){'; ' + remedy if remedy else ''}"
        ) from None


def save_model_weights(model: torch.nn.Module, path: Path) -> None:
    """The model's weights; a model whose frozen base is referenced (``checkpoint_base``: LoRA,
    `veil.models.lora.BaseRef`) saves every tensor but the base, with the reference as metadata."""
    tmp = path.with_name(path.name + ".tmp")
    base = getattr(model, "checkpoint_base", None)
    if base is None:
        save_model(model, str(tmp))  # handles tied weights
    else:
        part = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items() if k not in base.keys}
        save_file(part, str(tmp), metadata=dict(base.metadata))
    publish(tmp, path)


def _file_metadata(path: Path) -> dict[str, str]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return dict(f.metadata() or {})


def _load_partial(model: torch.nn.Module, base: Any, sd: dict[str, torch.Tensor], path: Path) -> None:
    """Load an adapters-only checkpoint into `model`, whose base must be the one it references."""
    meta = _file_metadata(path)
    digest = meta.get("veil.base.sha256")
    if digest is None:
        raise VeilError(
            f"checkpoint '{path}' holds a whole model, but this run trains LoRA adapters on a frozen base (train.lora)"
        )
    if digest != base.metadata["veil.base.sha256"]:
        raise VeilError(
            f"checkpoint '{path}' was trained on another base model (base sha256 {digest[:12]}..., this run's "
            f"{base.metadata['veil.base.sha256'][:12]}...); rebuild the run's base (model config, train.seed)"
        )
    want = {k for k in model.state_dict() if k not in base.keys}
    extra, missing = sorted(set(sd) - want), sorted(want - set(sd))
    if extra or missing:
        raise VeilError(f"checkpoint '{path}' does not fit the model's adapters (e.g. key '{(extra or missing)[0]}')")
    try:
        model.load_state_dict(sd, strict=False)
    except RuntimeError:
        raise VeilError(f"checkpoint '{path}' does not fit the model (a tensor of the wrong shape)") from None


def load_model_weights(model: torch.nn.Module, path: Path) -> None:
    """Load a safetensors checkpoint into `model`; keys of older layouts are renamed first
    (`legacy_keys`), and a parameter tied to one the file holds needs no key of its own."""
    verify(path)
    try:
        sd = load_file(str(path))
    except (SafetensorError, OSError):
        raise VeilError(f"checkpoint '{path}' is not a readable safetensors file") from None
    base = getattr(model, "checkpoint_base", None)
    if base is not None:
        _load_partial(model, base, sd, path)
        return
    sd = legacy_keys(model, sd)
    try:
        missing, unexpected = model.load_state_dict(sd, strict=False)
    except RuntimeError:  # a key that fits with the wrong shape
        raise VeilError(f"checkpoint '{path}' does not fit the model (a tensor of the wrong shape)") from None
    bad = list(unexpected) + [k for k in missing if not _tied_to_loaded(model, k, sd)]
    if bad and "veil.base.sha256" in _file_metadata(path):
        raise VeilError(
            f"checkpoint '{path}' holds LoRA adapters only; build the model with the run's train.lora to load it"
        )
    if bad:
        raise VeilError(f"checkpoint '{path}' does not fit the model (e.g. key '{bad[0]}')")


def legacy_keys(model: torch.nn.Module, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename keys saved under a submodule's old module paths to its current ones.

    A submodule lists ``legacy_prefixes`` {old prefix: new prefix} (relative to itself): the HF
    adapters once registered ``_emb`` / ``_layers`` / ``_t`` as second paths to their HF modules,
    and safetensors kept those names. A key whose new name is also present is dropped
    (the same tensor twice)."""
    rules = [
        (f"{where}.{old}" if where else old, f"{where}.{new}" if where else new)
        for where, mod in model.named_modules()
        for old, new in getattr(mod, "legacy_prefixes", {}).items()
    ]
    if not rules:
        return sd
    out: dict[str, torch.Tensor] = {}
    for key, value in sd.items():
        for old, new in rules:
            if key.startswith(old):
                key = new + key[len(old) :]
                break
        out.setdefault(key, value)
    return out


def _tied_to_loaded(model: torch.nn.Module, key: str, sd: dict[str, torch.Tensor]) -> bool:
    """True when parameter `key` is the same tensor as a parameter the checkpoint loaded."""
    params = dict(model.named_parameters(remove_duplicate=False))
    p = params.get(key)
    return p is not None and any(q is p for name, q in params.items() if name in sd)
