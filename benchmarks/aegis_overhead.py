"""Step-time overhead of AEGIS (and DP-SGD) against an undefended step, in one run.

Each repeat times one optimiser step of every variant on the same batch, interleaved (so drift of
the shared machine hits all variants alike); we report medians and the ratio to `none`.

    python benchmarks/aegis_overhead.py --model minilm --batch 16 --len 48 --repeats 10 --json out.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from veil.defenses import create_defense
from veil.models import create_model
from veil.training.loop import make_optimizer
from veil.training.step import client_step

VARIANTS: dict[str, list[tuple[str, dict[str, Any]]]] = {
    "none": [],
    "aegis": [("aegis", {})],
    "aegis-published": [("aegis", {"mlp_down_noise": 0.0})],
    "dpsgd": [("dpsgd", {"clip": 1.0, "noise_multiplier": 1.0})],
}


def make_batch(vocab: int, batch: int, length: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1000, vocab, (batch, length), generator=g)
    ids[:, 0], ids[:, -1] = 101, 102
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.randint(0, 2, (batch,), generator=g)}


def bench(model_name: str, batch: int, length: int, repeats: int, variants: list[str], model_kw: dict[str, Any] | None = None) -> dict[str, Any]:
    setups = {}
    for name in variants:
        torch.manual_seed(0)
        model = create_model(model_name, **(model_kw or {}))
        defenses = [create_defense(d, **kw).attach(model) for d, kw in VARIANTS[name]]
        setups[name] = (model, defenses, make_optimizer(model, 1e-5, 0.0))
    vocab = next(iter(setups.values()))[0].token_embedding().weight.shape[0]
    b = make_batch(vocab, batch, length)
    times: dict[str, list[float]] = {n: [] for n in variants}
    for r in range(repeats + 1):  # the first round warms up
        for name, (model, defenses, opt) in setups.items():
            t0 = time.perf_counter()
            client_step(model, b, defenses, opt, step=r, clip=1.0)
            if r:
                times[name].append(time.perf_counter() - t0)
    med = {n: statistics.median(t) for n, t in times.items()}
    return {"model": model_name, "batch": batch, "len": length, "repeats": repeats, "threads": torch.get_num_threads(),
            "median_s": med, "ratio_to_none": {n: med[n] / med["none"] for n in med}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="transformer4")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--len", type=int, default=48)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--variants", default="none,aegis,aegis-published,dpsgd")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    res = bench(a.model, a.batch, a.len, a.repeats, a.variants.split(","))
    print(json.dumps(res, indent=2))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
