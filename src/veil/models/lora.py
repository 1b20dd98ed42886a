"""LoRA adapters on any veil model, with Hugging Face `peft` (Hu et al., ICLR 2022, "LoRA:
Low-Rank Adaptation of Large Language Models").

A target linear layer ``y = W x`` becomes ``y = W x + (alpha / r) B A dropout(x)`` with
``A`` (r, in) drawn at random (peft's Kaiming-uniform init) and ``B`` (out, r) zero, so the model
computes exactly what the base computes until the first step. Only the adapters train: every base
weight is frozen (``requires_grad=False``), so the client step (`veil.training.step`) exports
the adapters' gradients and nothing of the base.

Targets are named by veil's model handles, the same for every family (veil's own presets, the
Hugging Face adapters, and folders loaded by path): ``q``, ``k``, ``v``, ``o`` (the attention
projections of every block, `attention_layers`), ``up`` (the MLP expansion, `mlp_up`: gate and up
where a block has both) and ``down`` (`mlp_down`); a name that is none of these selects the
linear layers whose module path ends in it (``c_attn``, ``q_proj``). HF GPT-2's fused Conv1D
(stored (in, out)) is adapted with peft's ``fan_in_fan_out``.

The task head: a classification head trains beside the adapters (``head: auto``): its class
count comes from the data, so it is fresh; a language model's head stays frozen (it is the
pretrained vocabulary projection, often tied to the token embedding). ``head: true / false``
overrides.

The base is referenced, not copied: `apply_lora` records the SHA-256 of the base model's whole
state (before injection) and its model config on the model (`BaseRef`, as ``checkpoint_base``).
Checkpoints (`veil.io.save_model_weights`) then hold every tensor that is not base (adapters,
the head when it trains, any defense's own parameters) with the reference as metadata, and
loading checks that the rebuilt base has the same digest; federated learning exchanges the same
tensors only (`exchanged_state`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from veil.errors import VeilError
from veil.models.base import VeilModel
from veil.registry import TUNERS

#: the handle names a target list may use, and the default targets
HANDLE_TARGETS = ("q", "k", "v", "o", "up", "down")
#: metadata keys of an adapters-only checkpoint
META_DIGEST, META_MODEL, META_LORA = "veil.base.sha256", "veil.base.model", "veil.lora"


@dataclass(frozen=True)
class BaseRef:
    """The frozen base of a LoRA model: the state-dict keys that are not saved or exchanged, and
    the metadata an adapters-only checkpoint carries (base digest, model config, LoRA settings)."""

    keys: frozenset[str]
    metadata: dict[str, str]

    @property
    def digest(self) -> str:
        return self.metadata[META_DIGEST]


def state_digest(state: dict[str, Tensor]) -> str:
    """SHA-256 over a state dict's names, dtypes, shapes and bytes, in key order."""
    h = hashlib.sha256()
    for k in sorted(state):
        t = state[k].detach().cpu().contiguous()
        h.update(f"{k}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    return h.hexdigest()


def _flat(items: Any) -> list[nn.Module]:
    """A handle's modules, flattened (a handle may hold a list where a block has several)."""
    if isinstance(items, nn.Module):
        return [items]
    return [m for x in items for m in _flat(x)] if isinstance(items, Iterable) else []


def _handle_modules(model: VeilModel, name: str) -> list[nn.Module]:
    if name in ("q", "k", "v", "o"):
        return [getattr(layer, name) for layer in model.attention_layers()]
    return _flat(model.mlp_up() if name == "up" else model.mlp_down())


def _adaptable(m: nn.Module) -> bool:
    return isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"


def target_paths(model: VeilModel, targets: list[str]) -> list[str]:
    """The module paths `targets` select (handle names or module-name suffixes), in model order;
    a target that selects nothing is a one-line error naming what is allowed."""
    paths = {id(m): n for n, m in model.named_modules()}
    chosen: dict[str, None] = {}
    for t in targets:
        if t in HANDLE_TARGETS:
            try:
                mods = _handle_modules(model, t)
            except NotImplementedError:
                mods = []
            found = [paths[id(m)] for m in mods if id(m) in paths and _adaptable(m)]
        else:
            found = [n for n, m in model.named_modules() if (n == t or n.endswith("." + t)) and _adaptable(m)]
        if not found:
            raise VeilError(
                f"train.lora.targets: {t!r} selects no linear layer of {type(model).__name__}; "
                f"allowed: {', '.join(HANDLE_TARGETS)} or the name of a linear layer (e.g. q_proj)"
            )
        chosen.update(dict.fromkeys(found))
    order = {n: i for i, (n, _) in enumerate(model.named_modules())}
    return sorted(chosen, key=order.__getitem__)


def check_settings(r: Any, alpha: Any, dropout: Any, targets: Any, head: Any) -> None:
    """One line per bad `train.lora` value."""
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise VeilError(f"train.lora.r must be an integer >= 1 (the adapter rank), got {r!r}")
    if alpha is not None and (isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha <= 0):
        raise VeilError(f"train.lora.alpha must be a number > 0 (the update is scaled by alpha / r), got {alpha!r}")
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise VeilError(f"train.lora.dropout must be in [0, 1), got {dropout!r}")
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) and t for t in targets):
        raise VeilError(
            f"train.lora.targets must be a non-empty list of names ({', '.join(HANDLE_TARGETS)} or layer names), got {targets!r}"
        )
    if head not in ("auto", True, False):
        raise VeilError(f"train.lora.head must be auto, true or false, got {head!r}")


@TUNERS.register("lora", "LoRA adapters (peft) on the attention and MLP layers; the base frozen")
def apply_lora(
    model: VeilModel,
    base: dict[str, Any] | None = None,
    r: int = 8,
    alpha: float | None = None,
    dropout: float = 0.0,
    targets: list[str] | str | None = None,
    head: bool | str = "auto",
) -> VeilModel:
    """Inject LoRA adapters into `model` in place and freeze its base; returns the model.

    base: the model config the base was built from (recorded in checkpoints).
    r: the adapters' rank.
    alpha: the scale numerator (the update is alpha / r x B A x); unset: 2 r.
    dropout: dropout on the adapters' input (peft's lora_dropout).
    targets: handle names (q, k, v, o, up, down) or linear-layer names; unset: all six handles.
    head: whether the task head trains (auto: a classification head does, an LM head does not).
    """
    from peft import LoraConfig, inject_adapter_in_model

    if isinstance(targets, str):
        targets = [targets]
    targets = list(HANDLE_TARGETS) if targets is None else targets
    check_settings(r, alpha, dropout, targets, head)
    if getattr(model, "checkpoint_base", None) is not None:
        raise VeilError("this model already carries LoRA adapters; apply train.lora once")
    alpha = float(2 * r if alpha is None else alpha)
    paths = target_paths(model, targets)
    digest = state_digest(model.state_dict())
    mods = dict(model.named_modules())
    conv = [p for p in paths if type(mods[p]).__name__ == "Conv1D"]
    if conv and len(conv) < len(paths):  # peft takes one fan_in_fan_out per config
        raise VeilError(f"train.lora.targets mix Conv1D ({conv[0]}) and nn.Linear layers; adapt one kind at a time")
    config = LoraConfig(
        r=r, lora_alpha=alpha, lora_dropout=float(dropout), target_modules=paths, fan_in_fan_out=bool(conv)
    )
    inject_adapter_in_model(config, model)  # freezes every parameter that is not an adapter
    train_head = model.task == "classification" if head == "auto" else bool(head)
    if train_head:
        for p in model.classifier().parameters():
            p.requires_grad_(True)
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    settings = {"r": r, "alpha": alpha, "dropout": float(dropout), "targets": paths, "head": train_head}
    meta = {META_DIGEST: digest, META_MODEL: json.dumps(base or {}, sort_keys=True), META_LORA: json.dumps(settings)}
    model.checkpoint_base = BaseRef(frozenset(k for k in model.state_dict() if k not in trained), meta)
    return model


def base_ref(model: nn.Module) -> BaseRef | None:
    """The model's `BaseRef` when it carries LoRA adapters, else None."""
    ref = getattr(model, "checkpoint_base", None)
    return ref if isinstance(ref, BaseRef) else None


def exchanged_state(model: nn.Module) -> dict[str, Tensor]:
    """The state a server and its clients exchange: the whole state dict, or with LoRA every
    tensor but the frozen base (the adapters, a trained head, a defense's own parameters)."""
    ref = base_ref(model)
    state = model.state_dict()
    return state if ref is None else {k: v for k, v in state.items() if k not in ref.keys}


def is_lora(module: nn.Module) -> bool:
    """Whether `module` is a peft LoRA layer (a base layer with adapters A and B)."""
    return hasattr(module, "lora_A") and hasattr(module, "lora_B") and hasattr(module, "base_layer")


def adapter_pair(module: nn.Module) -> tuple[nn.Parameter, nn.Parameter, float]:
    """(A (r, in), B (out, r), scale alpha / r) of a LoRA layer's active adapter."""
    name = next(iter(module.lora_A))
    return module.lora_A[name].weight, module.lora_B[name].weight, float(module.scaling[name])


def lora_modules(model: nn.Module) -> list[nn.Module]:
    """Every LoRA layer of `model`, in model order."""
    return [m for m in model.modules() if is_lora(m)]


__all__ = [
    "BaseRef",
    "HANDLE_TARGETS",
    "adapter_pair",
    "apply_lora",
    "base_ref",
    "exchanged_state",
    "is_lora",
    "lora_modules",
    "state_digest",
    "target_paths",
]
