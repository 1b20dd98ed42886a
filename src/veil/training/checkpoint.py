"""Checkpoints as safetensors (never pickle): model weights, optimiser state, loop state.

Files are written to a temporary name and renamed, so an interruption never leaves a
half-written checkpoint behind. Each checkpoint (and each cached result written with
`write_checked_text`) gets a `NAME.sha256` beside it, recorded at write time; a file whose bytes
no longer match it is never silently reused (`intact`, `verify`).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file, save_model

from veil.errors import VeilError


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# ---- integrity: a SHA-256 recorded at write time, checked on reuse ----------------------------
def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _hash_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _publish(tmp: Path, path: Path) -> None:
    """Rename `tmp` to `path` with its hash beside it (the two renames back to back)."""
    side = _hash_path(path).with_name(_hash_path(path).name + ".tmp")
    side.write_text(sha256_file(tmp) + "\n")
    os.replace(tmp, path)
    os.replace(side, _hash_path(path))


def write_checked_text(path: Path, text: str) -> None:
    """`atomic_write_text` plus the SHA-256 that `intact` checks."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    _publish(tmp, path)


def intact(path: Path) -> bool:
    """False when `path` is missing or its bytes differ from the hash recorded when it was
    written; True otherwise (a file written before hashes were recorded cannot be checked)."""
    if not path.is_file():
        return False
    side = _hash_path(path)
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


def save_tensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """A safetensors file of named tensors (an optimiser state), renamed into place with its hash."""
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp))
    _publish(tmp, path)


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
    tmp = path.with_name(path.name + ".tmp")
    save_model(model, str(tmp))  # handles tied weights
    _publish(tmp, path)


def load_model_weights(model: torch.nn.Module, path: Path) -> None:
    """Load a safetensors checkpoint into `model`; keys of older layouts are renamed first
    (`legacy_keys`), and a parameter tied to one the file holds needs no key of its own."""
    verify(path)
    try:
        sd = load_file(str(path))
    except (SafetensorError, OSError):
        raise VeilError(f"checkpoint '{path}' is not a readable safetensors file") from None
    sd = legacy_keys(model, sd)
    try:
        missing, unexpected = model.load_state_dict(sd, strict=False)
    except RuntimeError:  # a key that fits with the wrong shape
        raise VeilError(f"checkpoint '{path}' does not fit the model (a tensor of the wrong shape)") from None
    bad = list(unexpected) + [k for k in missing if not _tied_to_loaded(model, k, sd)]
    if bad:
        raise VeilError(f"checkpoint '{path}' does not fit the model (e.g. key '{bad[0]}')")


def legacy_keys(model: torch.nn.Module, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename keys saved under a submodule's old module paths to its current ones.

    A submodule lists ``legacy_prefixes`` {old prefix: new prefix} (relative to itself): the HF
    adapters once registered ``_emb`` / ``_layers`` / ``_t`` as second paths to their HF modules,
    and safetensors kept those names (issue 17). A key whose new name is also present is dropped
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


def optimizer_tensors(opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Flatten an optimiser's state into named tensors plus JSON-able scalars."""
    sd = opt.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, Any] = {"param_groups": sd["param_groups"], "state": {}}
    for idx, st in sd["state"].items():
        for k, v in st.items():
            if torch.is_tensor(v):
                tensors[f"{idx}.{k}"] = v.contiguous()
            else:
                scalars["state"].setdefault(str(idx), {})[k] = v
    return tensors, scalars


def restore_optimizer(opt: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], scalars: dict[str, Any]) -> None:
    state: dict[int, dict[str, Any]] = {}
    for key, v in tensors.items():
        idx, k = key.split(".", 1)
        state.setdefault(int(idx), {})[k] = v
    for idx, st in scalars["state"].items():
        state.setdefault(int(idx), {}).update(st)
    opt.load_state_dict({"state": state, "param_groups": scalars["param_groups"]})


def save_training_state(ckdir: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, loop: dict[str, Any]) -> None:
    """Weights, optimiser and loop counters; `state.json` is renamed last, so it marks completeness."""
    ckdir.mkdir(parents=True, exist_ok=True)
    save_model_weights(model, ckdir / "last.safetensors")
    tensors, scalars = optimizer_tensors(opt)
    save_tensors(tensors, ckdir / "optimizer.safetensors")
    atomic_write_text(ckdir / "state.json", json.dumps({"loop": loop, "optimizer": scalars}))


def load_training_state(ckdir: Path, model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any] | None:
    """The loop counters of the checkpoint in `ckdir` (weights and optimiser restored), or None.
    A damaged checkpoint is a one-line error, never a traceback or a silent restart."""
    state_path = ckdir / "state.json"
    if not state_path.is_file():
        return None
    remedy = f"remove '{ckdir}' to restart the run from its first step"
    try:
        state = json.loads(state_path.read_text())
        loop, scalars = state["loop"], state["optimizer"]
    except (ValueError, KeyError, TypeError):
        raise VeilError(f"checkpoint '{state_path}' is damaged (not the JSON veil wrote); {remedy}") from None
    try:
        load_model_weights(model, ckdir / "last.safetensors")
    except VeilError as e:
        raise VeilError(f"{e}; {remedy}") from None
    path = ckdir / "optimizer.safetensors"
    try:
        restore_optimizer(opt, load_tensors(path, remedy), scalars)
    except (ValueError, KeyError, RuntimeError):
        raise VeilError(
            f"checkpoint '{path}' is not a readable optimiser state (truncated or damaged); {remedy}"
        ) from None
    return loop
