"""The census of what the server sees: every parameter of a defended model, as the client's update
exports it, against the clean gradient of the same step.

  clean    exported, equal to the plain gradient (the defense does not touch it)
  noised   exported, changed by the defense: ``nsr`` = ||exported - plain|| / ||plain|| (the
           noise-to-signal ratio of the tensor; inf where the plain gradient is zero)
  frozen   not trainable (the defense or the model froze it): no update, nothing exported
  absent   trainable but no gradient reached it this step (unused by the forward pass)

Each tensor also carries its role (the model's handles: token embedding, position table,
attention, MLP expansion / down-projection, LM head or classifier, normalisation, other) and, given
attacks, the ones that read it in closed form (`Attack.reads`). A defense whose gradient transform
is random (AEGIS, the Gaussian baseline, DP-SGD) is compared with the plain gradient of the same
batch and weights; one that only transforms the batch (MJP) exports the gradient of what the
client computed, which the census counts as clean.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from veil.attacks.base import Attack, observe
from veil.defenses.base import Defense
from veil.models.base import VeilModel
from veil.training.step import compute_loss

STATES = ("clean", "noised", "frozen", "absent")


def roles(model: VeilModel) -> dict[str, str]:
    """Each parameter's role, from the model's handles (unnamed ones: 'norm' for vectors of a
    LayerNorm / RMSNorm, else 'other')."""
    ids: dict[int, str] = {}

    def put(mods: Any, role: str) -> None:
        for m in mods if isinstance(mods, list | tuple) else [mods]:
            if isinstance(m, list | tuple):
                put(m, role)
                continue
            for p in m.parameters(recurse=False) if isinstance(m, torch.nn.Module) else [m]:
                ids.setdefault(id(p), role)

    text = model.modality == "text"
    put(model.token_embedding(), "token_embedding" if text else "patch_embedding")
    if model.absolute_positions:  # RoPE decoders and CNNs have no table
        put([model.position_table()], "position")
    for att in model.attention_layers():
        put([att.q, att.k, att.v, att.o], "attention")
    put(list(model.mlp_up()), "mlp_up")
    put(list(model.mlp_down()), "mlp_down")
    put(model.classifier(), "head")
    out = {}
    for name, p in model.named_parameters():
        role = ids.get(id(p))
        if role is None:
            low = name.lower()
            role = "norm" if ("norm" in low or "ln" in low.split(".")[-2:][0]) and p.dim() == 1 else "other"
        out[name] = role
    return out


def _transforms_grads(d: Defense) -> bool:
    return d.backward is not None or type(d).transform_grads is not Defense.transform_grads


def plain_grads(model: VeilModel, batch: dict[str, Tensor], defenses: list[Defense]) -> dict[str, Tensor]:
    """The step's gradient before any defense's gradient transform (the frozen set kept)."""
    was = model.training
    model.zero_grad(set_to_none=True)
    loss, _ = compute_loss(model, batch, defenses)
    loss.backward()
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}
    model.zero_grad(set_to_none=True)
    model.train(was)
    return out


def census(
    model: VeilModel,
    batch: dict[str, Tensor],
    defenses: list[Defense],
    attacks: dict[str, Attack] | None = None,
    step: int = 0,
) -> dict[str, dict[str, Any]]:
    """{parameter: {state, role[, nsr][, read_by]}} for one defended step on `batch` (module doc)."""
    start = [d.state_dict() for d in defenses]  # the census draws no noise an attack cell would
    try:
        exported = observe(model, batch, defenses, step=step).grads
        model.zero_grad(set_to_none=True)
        random = any(_transforms_grads(d) for d in defenses)
        plain = plain_grads(model, batch, defenses) if random else exported
    finally:
        for d, state in zip(defenses, start):
            d.load_state_dict(state)
    readers: dict[str, list[str]] = {}
    for name, a in (attacks or {}).items():
        if a.applies_to(model) is None:
            for p in a.reads(model):
                readers.setdefault(p, []).append(name)
    out: dict[str, dict[str, Any]] = {}
    for name, p in model.named_parameters():
        entry: dict[str, Any] = {"role": roles_cache(model).get(name, "other")}
        if not p.requires_grad:
            entry["state"] = "frozen"
        elif name not in exported:
            entry["state"] = "absent"
        else:
            g, g0 = exported[name].double(), plain.get(name)
            if g0 is None or torch.equal(exported[name], g0):
                entry["state"] = "clean"
            else:
                entry["state"] = "noised"
                base = float(g0.double().norm())
                entry["nsr"] = float((g - g0.double()).norm()) / base if base > 0 else float("inf")
        if attacks is not None and entry["state"] in ("clean", "noised"):
            entry["read_by"] = sorted(readers.get(name, []))
        out[name] = entry
    return out


_ROLES: dict[int, dict[str, str]] = {}


def roles_cache(model: VeilModel) -> dict[str, str]:
    """`roles(model)`, computed once per model object."""
    if id(model) not in _ROLES:
        _ROLES.clear()
        _ROLES[id(model)] = roles(model)
    return _ROLES[id(model)]


def clean_unread(entries: dict[str, dict[str, Any]], readable: set[str]) -> list[str]:
    """The clean tensors that some attack could read (`readable`) but none of the census's attacks reads."""
    return sorted(n for n, e in entries.items() if e["state"] == "clean" and n in readable and not e.get("read_by"))


def summarize(entries: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Counts by state, and the noise-to-signal range of the noised tensors."""
    counts = {s: sum(1 for e in entries.values() if e["state"] == s) for s in STATES}
    nsr = [e["nsr"] for e in entries.values() if e["state"] == "noised"]
    return {**counts, "nsr_min": min(nsr) if nsr else None, "nsr_max": max(nsr) if nsr else None}
