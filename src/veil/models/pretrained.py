"""Pretrained checkpoints as `model.init`: a folder written by `veil pretrain` (or by `save`).

A folder holds ``model.safetensors`` (with its ``.sha256``) and ``pretrained.json``: the model's
registry name, every option of its config (the architecture), where it was pretrained and how
long it took. Only safetensors are read, never a pickle.

``model: {name: vit-digits, init: runs/pretrained/vit-lfw}`` builds the model with the folder's
architecture under the run's options, then loads the weights. Two options may differ from the
checkpoint's, because a fine-tune on other data changes them: ``num_classes`` (the classifier is
then freshly initialised: its weights are left out of the load) and ``max_len`` (a fine-tune may
use shorter sequences: the checkpoint's longer table is kept). Any other difference (width,
depth, image size, channels, vocabulary) is a one-line error naming the option, since those
weights would not fit.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from veil.errors import VeilError

FORMAT = "veil-pretrained/1"
META = "pretrained.json"
WEIGHTS = "model.safetensors"
#: options a fine-tune may change: a new head, or shorter sequences than pretraining saw
FLEXIBLE = ("num_classes", "max_len")


def read_meta(path: str | Path) -> dict[str, Any]:
    """The checkpoint folder's `pretrained.json`; a one-line error when it is not one."""
    folder = Path(path)
    meta_file = folder / META
    if not folder.is_dir() or not meta_file.is_file() or not (folder / WEIGHTS).is_file():
        raise VeilError(
            f"model.init '{path}' is not a pretrained checkpoint folder (it needs {META} and {WEIGHTS}; "
            "write one with `veil pretrain CONFIG --out DIR`)"
        )
    try:
        meta = json.loads(meta_file.read_text())
    except json.JSONDecodeError:
        raise VeilError(f"model.init '{path}': {META} is not valid JSON") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise VeilError(f"model.init '{path}': {META} is not a {FORMAT} file")
    return meta


def merged_options(name: str, path: str | Path, defaults: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """The options to build `name` with: the checkpoint's architecture, checked against the run's."""
    meta = read_meta(path)
    if meta.get("model") != name:
        raise VeilError(f"model.init '{path}' holds a {meta.get('model')!r} model, not {name!r}; set model.name to it")
    saved = dict(meta.get("options") or {})
    out = {**defaults, **saved}
    for key, value in overrides.items():
        if key not in saved or saved[key] == value or key == "num_classes":
            out[key] = value
        elif key == "max_len":
            if value > saved[key]:
                raise VeilError(
                    f"model.init '{path}' was pretrained with max_len {saved[key]}; the data needs {value} (lower data.max_len)"
                )
        else:
            raise VeilError(
                f"model.init '{path}' was pretrained with {key}={saved[key]!r}, this run asks for {value!r}; "
                f"the weights fit only the same {key} (drop the option, or resize the data to match)"
            )
    return out


def load_into(model: Any, path: str | Path) -> None:
    """Load the checkpoint's weights into `model`; a head of another size stays freshly initialised."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from veil.io import verify

    file = Path(path) / WEIGHTS
    verify(file, "run `veil pretrain` again to rebuild it")
    try:
        sd = load_file(str(file))
    except (SafetensorError, OSError):
        raise VeilError(f"model.init '{path}': {WEIGHTS} is not a readable safetensors file") from None
    own = model.state_dict()
    head = {f"{n}" for n, _ in _named_in(model, model.classifier())}
    fresh = {k for k in head if k in sd and sd[k].shape != own[k].shape}
    sd = {k: v for k, v in sd.items() if k not in fresh}
    bad_shape = [k for k, v in sd.items() if k in own and own[k].shape != v.shape]
    if bad_shape:
        raise VeilError(f"model.init '{path}' does not fit the model (tensor '{bad_shape[0]}' has another shape)")
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [k for k in missing if k not in fresh and not _tied(model, k, sd)]
    if unexpected or missing:
        raise VeilError(f"model.init '{path}' does not fit the model (e.g. key '{(list(unexpected) + missing)[0]}')")


def _named_in(model: Any, module: Any) -> list[tuple[str, Any]]:
    """(state-dict key, tensor) of `module`'s parameters, by their names in `model`."""
    ids = {id(p) for p in module.parameters()}
    return [(n, p) for n, p in model.named_parameters(remove_duplicate=False) if id(p) in ids]


def _tied(model: Any, key: str, sd: dict[str, Any]) -> bool:
    """True when `key` names a parameter shared with one the file holds (a tied LM head)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    if key not in params:
        return False
    return any(params.get(k) is params[key] for k in sd)


def save(model: Any, name: str, folder: str | Path, extra: dict[str, Any] | None = None) -> Path:
    """Write `model` (registry name `name`) as a pretrained checkpoint folder."""
    from veil.io import atomic_write_text, save_model_weights

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    options = dataclasses.asdict(model.cfg)
    save_model_weights(model, out / WEIGHTS)
    meta = {"format": FORMAT, "model": name, "options": options, **(extra or {})}
    atomic_write_text(out / META, json.dumps(meta, indent=2) + "\n")
    return out
