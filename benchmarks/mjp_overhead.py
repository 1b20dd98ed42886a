"""MJP overhead: median wall time of one training step (forward, aux loss, backward, AdamW step)
with and without MJP, interleaved in one run so both see the same machine load.

    python benchmarks/mjp_overhead.py [--presets vit-digits vit-tiny transformer4 minilm] [--reps 30]

MJP runs with the paper's settings: images gamma 0.03, block-wise selection, DAL (lambda 0.01);
text gamma 0.5, window 32, no auxiliary loss (``--aux`` overrides). Goal: ratio <= 1.05.
Inputs are random tensors of the real shapes (timing does not depend on their content).
Two medians are printed: wall time, and the calling thread's CPU time (``time.thread_time``),
which with one torch thread is the step's compute and does not count time spent waiting for a
core on a loaded machine; on a quiet machine the two agree.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch

from veil.defenses.mjp import MJP
from veil.models import create_model
from veil.training.loop import make_optimizer
from veil.training.step import client_step

PRESETS = {
    "vit-digits": dict(kind="image", shape=(1, 8, 8), kw=dict(num_classes=10), batch=64),  # configs/vit_digits.yaml
    "vit-tiny": dict(kind="image", shape=(3, 32, 32), kw=dict(num_classes=10)),
    "transformer4": dict(kind="text", kw=dict(num_classes=2)),
    "minilm": dict(kind="text", kw=dict(num_classes=2)),
}


def make_batch(spec: dict, batch: int, seq_len: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    if spec["kind"] == "image":
        return {
            "pixels": torch.rand(batch, *spec["shape"], generator=g),
            "labels": torch.randint(0, 10, (batch,), generator=g),
        }
    ids = torch.randint(1000, 20000, (batch, seq_len), generator=g)
    lengths = torch.randint(seq_len // 2, seq_len + 1, (batch,), generator=g)
    pos = torch.arange(seq_len).expand(batch, seq_len)
    ids[:, 0] = 101
    ids[pos == (lengths - 1).unsqueeze(1)] = 102
    ids[pos >= lengths.unsqueeze(1)] = 0
    return {"input_ids": ids, "attention_mask": (ids != 0).long(), "labels": torch.randint(0, 2, (batch,), generator=g)}


def bench(name: str, reps: int, batch: int, seq_len: int, aux: str | None) -> dict[str, float]:
    spec = PRESETS[name]
    torch.manual_seed(0)
    base = create_model(name, **spec["kw"]).train()
    defended = copy.deepcopy(base)
    d = MJP(aux=aux).attach(defended)
    runs = [
        (base, [], make_optimizer(base, 1e-4, 0.01)),
        (defended, [d], make_optimizer(defended, 1e-4, 0.01)),
    ]  # the training loop's optimiser
    b = make_batch(spec, batch, seq_len, torch.Generator().manual_seed(0))
    wall: list[list[float]] = [[], []]
    cpu: list[list[float]] = [[], []]
    for i in range(reps + 3):
        order = (0, 1) if i % 2 == 0 else (1, 0)
        for j in order:
            model, defs, opt = runs[j]
            t0, c0 = time.perf_counter(), time.thread_time()
            client_step(model, b, defs, opt, export=False)
            if i >= 3:  # warm-up
                wall[j].append(time.perf_counter() - t0)
                cpu[j].append(time.thread_time() - c0)
    med = [[statistics.median(x) * 1e3 for x in pair] for pair in (wall, cpu)]
    return {
        "preset": name,
        "batch": batch,
        "undefended_ms": round(med[0][0], 2),
        "mjp_ms": round(med[0][1], 2),
        "ratio": round(med[0][1] / med[0][0], 3),
        "undefended_cpu_ms": round(med[1][0], 2),
        "mjp_cpu_ms": round(med[1][1], 2),
        "cpu_ratio": round(med[1][1] / med[1][0], 3),
        "mjp": d.describe(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", nargs="+", default=list(PRESETS), choices=list(PRESETS))
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument(
        "--batch",
        type=int,
        default=None,
        help="default: the preset's training batch (vit-digits 64, as configs/vit_digits.yaml), else 32",
    )
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--aux", default=None, choices=("dal", "drl", "none"))
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: on a shared 2-core machine, multi-threaded small matmuls stall "
        "waiting for a free core and the timing measures the load, not the step; 0: torch's default)",
    )
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    for name in args.presets:
        r = bench(name, args.reps, args.batch or PRESETS[name].get("batch", 32), args.seq_len, args.aux)
        rows.append(r)
        print(
            f"{name:14s} batch {r['batch']:3d} wall: undefended {r['undefended_ms']:9.2f} ms  mjp {r['mjp_ms']:9.2f} ms  ratio {r['ratio']:.3f}   "
            f"thread CPU: {r['undefended_cpu_ms']:9.2f} / {r['mjp_cpu_ms']:9.2f} ms  ratio {r['cpu_ratio']:.3f}",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
