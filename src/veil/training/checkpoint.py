"""Checkpoints: weights, optimiser state and loop counters, resumable after any interruption.

The file layer (safetensors, never pickle; temporary name then rename; a `NAME.sha256` beside
each file, checked before reuse) lives in `veil.io`; this module adds what a resumed run needs:
the optimiser flattened to named tensors, and `state.json`, written last, which marks a complete
checkpoint. The files of one checkpoint are published together (`veil.io.staged`): a kill while
the next one is written leaves the previous one whole.

One checkpoint is `last.safetensors` (the model, when the run has one to save whole), one
`GROUP.safetensors` per group of named tensors (optimiser, random streams, auditor memory, ...)
and `state.json` (`save_checkpoint`; read back with `read_state`, `load_weights`, `load_group`,
`load_optimizer`). `veil train`, the FedAvg server and the split-learning server all write it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from veil.errors import VeilError
from veil.io import (
    atomic_write_text,
    load_model_weights,
    load_tensors,
    save_model_weights,
    save_tensors,
    settle,
    staged,
)


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


def save_checkpoint(
    ckdir: Path,
    state: dict[str, Any],
    groups: dict[str, dict[str, torch.Tensor]],
    model: torch.nn.Module | None = None,
) -> None:
    """Publish one checkpoint as a set (`veil.io.staged`): `model`'s weights as `last.safetensors`
    (tied weights handled), one `NAME.safetensors` per group of named tensors, then `state`
    as `state.json`, written last, so it marks completeness. Every run kind checkpoints through it
    (`veil train`, the FedAvg server, the split-learning server)."""
    with staged(ckdir) as stage:
        if model is not None:
            save_model_weights(model, stage / "last.safetensors")
        for name, group in groups.items():
            save_tensors({k: v.detach().contiguous() for k, v in group.items()}, stage / f"{name}.safetensors")
        atomic_write_text(stage / "state.json", json.dumps(state))


def save_training_state(
    ckdir: Path,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    loop: dict[str, Any],
    streams: dict[str, torch.Tensor] | None = None,
) -> None:
    """Weights, optimiser, the defenses' random streams (`streams`) and loop counters, published as
    one set (`save_checkpoint`)."""
    tensors, scalars = optimizer_tensors(opt)
    state = {"loop": loop, "optimizer": scalars}
    save_checkpoint(ckdir, state, {"optimizer": tensors, "streams": streams or {}}, model)


def restart_remedy(ckdir: Path, unit: str = "step") -> str:
    """What the one-line error of a damaged checkpoint in `ckdir` tells the user to do (`unit`: what
    the run counts, ``step`` or ``round``)."""
    return f"remove '{ckdir}' to restart the run from its first {unit}"


def read_state(ckdir: Path, *keys: str, unit: str = "step") -> dict[str, Any] | None:
    """The checkpoint's `state.json` (None when there is none: no complete checkpoint), which must
    be a JSON object with `keys`; anything else is a one-line error, never a silent restart."""
    settle(ckdir)
    path = ckdir / "state.json"
    if not path.is_file():
        return None
    try:
        state = json.loads(path.read_text())
        if not isinstance(state, dict) or any(k not in state for k in keys):
            raise KeyError(path)
    except (ValueError, KeyError):
        raise VeilError(
            f"checkpoint '{path}' is damaged (not the JSON veil wrote); {restart_remedy(ckdir, unit)}"
        ) from None
    return state


def load_group(ckdir: Path, name: str, unit: str = "step", missing_ok: bool = False) -> dict[str, torch.Tensor]:
    """The tensors `save_checkpoint` saved as group `name` ({} for an absent group when
    `missing_ok`: a checkpoint written before the group was saved); a damaged file is a one-line
    `VeilError`."""
    path = ckdir / f"{name}.safetensors"
    if missing_ok and not path.is_file():
        return {}
    return load_tensors(path, restart_remedy(ckdir, unit))


def load_weights(ckdir: Path, model: torch.nn.Module, unit: str = "step") -> None:
    """Restore `model` from the checkpoint's `last.safetensors`; a damaged file is a one-line `VeilError`."""
    try:
        load_model_weights(model, ckdir / "last.safetensors")
    except VeilError as e:
        raise VeilError(f"{e}; {restart_remedy(ckdir, unit)}") from None


def load_optimizer(
    ckdir: Path, opt: torch.optim.Optimizer, name: str, scalars: dict[str, Any], unit: str = "step"
) -> None:
    """Restore `opt` from group `name` and the JSON `scalars` saved beside it (`optimizer_tensors`)."""
    tensors = load_group(ckdir, name, unit)
    try:
        restore_optimizer(opt, tensors, scalars)
    except (ValueError, KeyError, RuntimeError):
        path = ckdir / f"{name}.safetensors"
        raise VeilError(
            f"checkpoint '{path}' is not a readable optimiser state (truncated or damaged); {restart_remedy(ckdir, unit)}"
        ) from None


def load_streams(ckdir: Path) -> dict[str, torch.Tensor]:
    """The random streams `save_training_state` saved with the checkpoint ({} for a checkpoint
    written before streams were saved); a damaged file is a one-line `VeilError`."""
    settle(ckdir)
    return load_group(ckdir, "streams", missing_ok=True)


def load_training_state(ckdir: Path, model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any] | None:
    """The loop counters of the checkpoint in `ckdir` (weights and optimiser restored), or None.
    A damaged checkpoint is a one-line error, never a traceback or a silent restart."""
    state = read_state(ckdir, "loop", "optimizer")
    if state is None:
        return None
    load_weights(ckdir, model)
    load_optimizer(ckdir, opt, "optimizer", state["optimizer"])
    return state["loop"]
