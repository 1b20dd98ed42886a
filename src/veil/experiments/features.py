"""Frozen-encoder features shared by the runs of one audit (`train.frozen_features: true`).

A run with `train.frozen_features` trains its classifier on the frozen encoder's output h(x)
(`veil.training.frozen`: DP linear probing). An audit often trains many such runs on one encoder
and one data set — a screen of learning rates, the epsilons of a privacy-utility curve, its seeds
— and h(x) is the same for every one of them. The engine computes it once per (encoder weights,
splits) and hands each run its splits as the head sees them, ``{FEATURES: h(x), "labels": y}``;
`veil.training.loop.train` then trains exactly as on the features it would compute itself (its
`feature_split` passes cached features through unchanged: the model sends a FEATURES batch
straight to its classifier, whose input is what the cache holds).

Both splits are cached: each epoch's evaluation then costs the head's forward, not the encoder's
(the loop alone evaluates the whole model on the raw test inputs; the logits are the same up to
the float rounding of a different padding width). The cache is AUDIT/features/KEY.safetensors,
written with its hash like every cached result; KEY digests the model and data settings, every
weight outside the classifier and every tensor of both splits, so a different encoder (another
seed of a model at random init) or other data never reuses it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from veil.build import build_run
from veil.config import RunConfig
from veil.data import DataSplits
from veil.defenses.base import Defense
from veil.errors import VeilError
from veil.io import intact, load_tensors, save_tensors
from veil.models.base import FEATURES, VeilModel
from veil.runtime import use_threads
from veil.training.frozen import encoder_features, refusal
from veil.training.loop import pick_device

SPLITS = ("train", "test")


def _digest(h: Any, t: Tensor) -> None:
    t = t.detach().cpu().contiguous()
    h.update(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")


def feature_key(cfg: RunConfig, model: VeilModel, data: DataSplits) -> str:
    """A digest of what the features depend on: the model and data settings, the weights outside
    the classifier (the frozen encoder) and the inputs of both splits."""
    h = hashlib.sha256(json.dumps([cfg.model, cfg.data], sort_keys=True, default=str).encode())
    head = {id(p) for p in model.classifier().parameters()}
    for name, p in model.named_parameters():
        if id(p) not in head:
            h.update(name.encode())
            _digest(h, p)
    for split in SPLITS:
        for k, v in sorted(getattr(data, split).items()):
            h.update(f"{split}.{k}".encode())
            _digest(h, v)
    return h.hexdigest()[:24]


def frozen_run(cfg: RunConfig, cache: Path, progress: bool = False) -> tuple[VeilModel, DataSplits, list[Defense]]:
    """The run's model, defenses and its data with both splits as the head sees them: read from
    `cache` when an earlier run of the audit computed them, else computed (one forward of the
    frozen encoder over each split) and written there. One line when the run cannot train on
    cached features (`veil.training.frozen.refusal`)."""
    model, data, defenses = build_run(cfg)
    why = refusal(model, defenses)
    if why is not None:
        raise VeilError(f"train.frozen_features: {why}")
    path = Path(cache) / f"{feature_key(cfg, model, data)}.safetensors"
    if path.is_file() and intact(path):
        feats = load_tensors(path, f"remove '{path}' to recompute it")
    else:
        use_threads(cfg.train.threads)  # as the loop computes them: the run's own thread setting
        device = pick_device(cfg.train.device)
        model.to(device)
        feats = {
            s: encoder_features(model, getattr(data, s), cfg.train.eval_batch_size, device, progress).cpu()
            for s in SPLITS
        }
        model.cpu()
        path.parent.mkdir(parents=True, exist_ok=True)
        save_tensors({k: v.contiguous() for k, v in feats.items()}, path)
    split = {s: {FEATURES: feats[s], "labels": getattr(data, s)["labels"]} for s in SPLITS}
    return model, dataclasses.replace(data, **split), defenses


__all__ = ["feature_key", "frozen_run"]
