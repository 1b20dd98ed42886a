"""Checkpoints as safetensors (never pickle): model weights, optimiser state, loop state.

Files are written to a temporary name and renamed, so an interruption never leaves a
half-written checkpoint behind.
"""
from __future__ import annotations

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


def save_model_weights(model: torch.nn.Module, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    save_model(model, str(tmp))  # handles tied weights
    os.replace(tmp, path)


def load_model_weights(model: torch.nn.Module, path: Path) -> None:
    """Load a safetensors checkpoint into `model`; keys of older layouts are renamed first
    (`legacy_keys`), and a parameter tied to one the file holds needs no key of its own."""
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
    rules = [(f"{where}.{old}" if where else old, f"{where}.{new}" if where else new)
             for where, mod in model.named_modules() for old, new in getattr(mod, "legacy_prefixes", {}).items()]
    if not rules:
        return sd
    out: dict[str, torch.Tensor] = {}
    for key, value in sd.items():
        for old, new in rules:
            if key.startswith(old):
                key = new + key[len(old):]
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
    tmp = ckdir / "optimizer.safetensors.tmp"
    save_file(tensors, str(tmp))
    os.replace(tmp, ckdir / "optimizer.safetensors")
    atomic_write_text(ckdir / "state.json", json.dumps({"loop": loop, "optimizer": scalars}))


def load_training_state(ckdir: Path, model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any] | None:
    state_path = ckdir / "state.json"
    if not state_path.is_file():
        return None
    state = json.loads(state_path.read_text())
    load_model_weights(model, ckdir / "last.safetensors")
    restore_optimizer(opt, load_file(str(ckdir / "optimizer.safetensors")), state["optimizer"])
    return state["loop"]
