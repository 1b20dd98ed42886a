"""Median time of one training step (batch 32) for each preset: the baseline that every
defense-overhead ratio is measured against.

    python benchmarks/train_step.py [--repeats 10] [--models vit-digits transformer4 ...]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from veil.models import create_model, list_models
from veil.training.loop import make_optimizer
from veil.training.step import client_step

TEXT_LEN = 64


def batch_for(model: torch.nn.Module, size: int) -> dict[str, torch.Tensor]:
    if model.modality == "image":
        cfg = getattr(model, "cfg", None)
        s = cfg.image_size if cfg else model.hf.config.image_size
        c = cfg.in_chans if cfg else model.hf.config.num_channels
        return {"pixels": torch.rand(size, c, s, s), "labels": torch.randint(0, 2, (size,))}
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, 5000, (size, TEXT_LEN), generator=g)
    ids[:, 0], ids[:, -1] = 101, 102
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "labels": torch.randint(0, 2, (size,), generator=g),
    }


def step_times(name: str, batch_size: int, repeats: int) -> list[float]:
    torch.manual_seed(0)
    model = create_model(name).train()
    opt = make_optimizer(model, 1e-4, 0.0)
    batch = batch_for(model, batch_size)
    client_step(model, batch, [], opt, clip=1.0, export=False)  # warm-up
    times = []
    for i in range(repeats):
        t0 = time.perf_counter()
        client_step(model, batch, [], opt, step=i, clip=1.0, export=False)
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--models", nargs="*", default=list_models())
    args = ap.parse_args()
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, batch {args.batch_size}, text length {TEXT_LEN}"
    )
    print(f"{'model':<14} {'median s/step':>14} {'min':>8} {'max':>8}")
    for name in args.models:
        t = step_times(name, args.batch_size, args.repeats)
        print(f"{name:<14} {statistics.median(t):>14.4f} {min(t):>8.4f} {max(t):>8.4f}")


if __name__ == "__main__":
    main()
