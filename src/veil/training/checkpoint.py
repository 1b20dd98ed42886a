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
from safetensors.torch import load_file, load_model, save_file, save_model

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
    try:
        missing, unexpected = load_model(model, str(path), strict=False)
    except (SafetensorError, OSError) as e:
        raise VeilError(f"checkpoint '{path}' is not a readable safetensors file") from None
    bad = [k for k in unexpected] + [k for k in missing if not _is_tied(model, k)]
    if bad:
        raise VeilError(f"checkpoint '{path}' does not fit the model (e.g. key '{bad[0]}')")


def _is_tied(model: torch.nn.Module, key: str) -> bool:
    params = dict(model.named_parameters(remove_duplicate=False))
    p = params.get(key)
    return p is not None and sum(q is p for q in params.values()) > 1


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
