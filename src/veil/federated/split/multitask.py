"""Three tasks on one offline image set for multi-task split learning (p-FeSTA's CXR setting,
scaled to scikit-learn digits so it runs on a laptop CPU):

  classify  digit class, 10-way cross-entropy; metric accuracy (the paper: COVID-19 classification)
  zones     "severity" regression: the ink mass in each of 6 zones (3 rows x 2 columns) of the
            image, in [0, 1], BCE on the 6 scores as the paper does for the 6 lung zones of
            Brixia severity; metric MSE (lower is better)
  segment   stroke segmentation of a noisy digit: input = digit + N(0, 0.25^2) noise, clipped;
            target = clean pixels > 0.5; BCE + Dice loss; metric Dice (the paper: pneumothorax)

Why these: the three are derived from the same images like the paper's three CXR tasks, two are
strongly related (class and zone ink both follow the digit's shape) and one is less so
(pixel-level denoising segmentation), and all targets are exact, computed, offline.
Each task's training data goes to its own clients (disjoint shards of the digits train split, the
same shard whether the task trains alone or with the others);
every task is evaluated on the digits test split.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from veil.data import load_data, subset
from veil.federated.split.models import CLSTail, Head, SegTail, build_vit
from veil.federated.split.spec import TASKS, SplitSpec, split_spec_from_text


@dataclass
class Task:
    name: str
    make_tail: Callable[[int, int, int], nn.Module]  # (dim, patch, size) -> tail
    loss: Callable[[Tensor, Tensor], Tensor]
    metric: Callable[[Tensor, Tensor], float]
    metric_name: str
    higher_is_better: bool
    reads_patches: bool = False  # False: the tail reads only [CLS], so only that token is exchanged


def zone_ink(pixels: Tensor) -> Tensor:
    """(B, 1, H, W) -> (B, 6): mean intensity of 3 x 2 zones, scaled to use [0, 1]."""
    z = F.adaptive_avg_pool2d(pixels, (3, 2)).flatten(1)
    return (z * 2.0).clamp(0, 1)


def dice(logits: Tensor, target: Tensor) -> Tensor:
    p = logits.sigmoid()
    inter = (p * target).flatten(1).sum(1)
    return ((2 * inter + 1) / (p.flatten(1).sum(1) + target.flatten(1).sum(1) + 1)).mean()


def hard_dice(logits: Tensor, target: Tensor) -> float:
    p = (logits > 0).float()
    inter = (p * target).flatten(1).sum(1)
    return float(((2 * inter + 1e-6) / (p.flatten(1).sum(1) + target.flatten(1).sum(1) + 1e-6)).mean())


TASK_DEFS: dict[str, Task] = {
    "classify": Task(
        "classify",
        lambda d, p, s: CLSTail(d, 10),
        lambda o, t: F.cross_entropy(o, t.long()),
        lambda o, t: float((o.argmax(-1) == t.long()).float().mean()),
        "accuracy",
        True,
    ),
    "zones": Task(
        "zones",
        lambda d, p, s: CLSTail(d, 6),
        lambda o, t: F.binary_cross_entropy_with_logits(o, t),
        lambda o, t: float(((o.sigmoid() - t) ** 2).mean()),
        "mse",
        False,
    ),
    "segment": Task(
        "segment",
        lambda d, p, s: SegTail(d, p, s),
        lambda o, t: F.binary_cross_entropy_with_logits(o, t) + 1 - dice(o, t),
        hard_dice,
        "dice",
        True,
        True,
    ),
}


def task_split(split: dict[str, Tensor], task: str, seed: int) -> dict[str, Tensor]:
    """Inputs and targets of one task: {"pixels", "target"}."""
    px = split["pixels"]
    if task == "classify":
        return {"pixels": px, "target": split["labels"]}
    if task == "zones":
        return {"pixels": px, "target": zone_ink(px)}
    g = torch.Generator().manual_seed(seed + 77)
    noisy = (px + 0.25 * torch.randn(px.shape, generator=g)).clamp(0, 1)
    return {"pixels": noisy, "target": (px > 0.5).float()}


def multitask_data(
    tasks: list[str], clients_per_task: int, seed: int, dataset: str = "digits"
) -> tuple[list[tuple[str, dict[str, Tensor]]], dict[str, dict[str, Tensor]]]:
    """[(task, train shard)] for every client (task-major order) and {task: test split}."""
    data = load_data(dataset, seed=seed)
    n = len(data.train["labels"])
    # shards are cut for all TASKS, so a task's clients hold the same data in single- and multi-task runs
    shards = np.array_split(np.random.default_rng(seed).permutation(n), len(TASKS) * clients_per_task)
    clients = []
    for t in tasks:
        i = TASKS.index(t)
        clients += [
            (t, task_split(subset(data.train, shards[i * clients_per_task + j]), t, seed + i * 100 + j))
            for j in range(clients_per_task)
        ]
    return clients, {t: task_split(data.test, t, seed + 999) for t in tasks}


@dataclass
class SplitWorld:
    spec: SplitSpec
    clients: list[tuple[str, dict[str, Tensor]]]
    tests: dict[str, dict[str, Tensor]]


@lru_cache(maxsize=4)
def split_world(spec_text: str) -> SplitWorld:
    spec = split_spec_from_text(spec_text)
    clients, tests = multitask_data(
        spec.split.tasks, spec.split.clients_per_task, spec.cfg.train.seed, spec.cfg.data["name"]
    )
    return SplitWorld(spec, clients, tests)


def build_parts(spec: SplitSpec, task: str) -> tuple[nn.Module, nn.Module]:
    """A fresh head and the task's tail, initialised identically (seeded) on every client of the task."""
    vit = build_vit(spec)
    torch.manual_seed(spec.cfg.train.seed + 17 * (1 + list(TASK_DEFS).index(task)))
    tail = TASK_DEFS[task].make_tail(vit.width, vit.cfg.patch_size, vit.cfg.image_size)
    return Head(vit, spec.split.head_pos), tail
