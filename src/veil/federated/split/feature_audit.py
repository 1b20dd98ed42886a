"""Feature-space attacks against split learning, with and without p-FeSTA's permutation module.

The victim: a client's batch of private training images, embedded by its (frozen) p-FeSTA head
and sent to the server either in patch order or permuted per sample. The attacker: the server,
with its own auxiliary images (the digits *test* split: disjoint from every client's training
data) and, for decoder inversion, query access to the head (a public pretrained embedder in the
paper's setting). PSNR / SSIM compare the rebuilt batch with the private one (Hungarian-matched).

The server runs the protocol, so it knows when the permutation is on (`Knowledge.defense`), and
`feature_inversion` then un-shuffles through the frozen head before decoding (its default,
`unshuffle: auto`): that row, `feature_inversion+unshuffle`, comes first and is the verdict
(`strongest`: the attack with the highest PSNR on the permuted features). The row
`feature_inversion` is the naive decoder (`unshuffle: false`) the paper's claim rests on.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from veil.attacks import Knowledge, Observation, create_attack
from veil.attacks.features import SPLIT_ROWS, row_entry
from veil.attacks.harness import budget_metrics
from veil.defenses.permutation import PatchPermutation
from veil.federated.split.multitask import build_parts, split_world
from veil.federated.split.spec import SplitSpec
from veil.metrics import image_report

#: the rows the feature attacks run by default, label -> options (`veil.attacks.features.row_entry`)
DEFAULT_ATTACKS: dict[str, dict[str, Any]] = SPLIT_ROWS


def victim_view(spec: SplitSpec, victims: int) -> tuple[Tensor, Tensor, Any, Tensor, PatchPermutation]:
    """The first client's private images, the server's public images, the frozen head, the clean
    head features the client computes, and the permutation module a p-FeSTA client would apply."""
    world = split_world(spec.text())
    head, _ = build_parts(spec, spec.split.tasks[0])
    head.requires_grad_(False)
    private = world.clients[0][1]["pixels"][:victims]
    aux = world.tests[spec.split.tasks[0]]["pixels"]
    with torch.no_grad():
        clean = head(private)
    return private, aux, head, clean, PatchPermutation(True, seed=spec.cfg.train.seed + 4242)


def attack_features(
    attack: Any, feats: Tensor, private: Tensor, aux: Tensor, head: Any, known: dict[str, Any], seed: int
) -> dict[str, float]:
    """One feature attack on what the server received, scored against the private images."""
    know = Knowledge(
        batch_size=len(private),
        input_shape=tuple(private.shape[1:]),
        aux_data={"pixels": aux, "head": head},
        defense=known,
        seed=seed,
    )
    rec = attack.reconstruct(Observation(model=None, features=feats, kind="features"), know)  # type: ignore[arg-type]
    rep = image_report(private, rec.images.clamp(0, 1))
    return {
        "psnr": float(rep["psnr"]),
        "ssim": float(rep["ssim"]),
        "mse": float(rep["mse"]),
        "seconds": float(rec.stats["seconds"]),
        **budget_metrics(rec.stats),
    }


def feature_attacks(
    spec: SplitSpec, victims: int = 64, attacks: dict[str, dict[str, Any]] | None = None
) -> dict[str, Any]:
    private, aux, head, clean, module = victim_view(spec, victims)
    permuted = module.before_send(clean, {})
    attacks = attacks or DEFAULT_ATTACKS
    out: dict[str, Any] = {"victims": victims, "aux": len(aux)}
    for name, settings in attacks.items():
        entry = row_entry(name, settings)
        attack = create_attack(entry.pop("name"), **entry)
        row = {}
        for label, feats in (("plain", clean), ("permuted", permuted)):
            known = {module.name: module.describe()} if label == "permuted" else {}  # the server knows its protocol
            row[label] = attack_features(attack, feats, private, aux, head, known, spec.cfg.train.seed)
            row[label]["seconds"] = round(row[label]["seconds"], 2)
        row["psnr_drop_db"] = row["plain"]["psnr"] - row["permuted"]["psnr"]
        out[name] = row
    rows = [k for k in attacks if isinstance(out.get(k), dict)]
    out["strongest"] = max(rows, key=lambda k: out[k]["permuted"]["psnr"]) if rows else None
    return out
