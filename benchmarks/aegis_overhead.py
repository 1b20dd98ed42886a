"""Step-time overhead of AEGIS (and DP-SGD) against an undefended step, in one run.

Each repeat times one optimiser step of every variant on the same batch, interleaved (so drift of
the shared machine hits all variants alike) and in reversed order every other round (so no variant
always runs right after the same neighbour, whose memory traffic it inherits); we report medians
and the ratio to `none`.

    python benchmarks/aegis_overhead.py --model minilm --batch 16 --len 48 --repeats 10 --json out.json
    python benchmarks/aegis_overhead.py --suite --device cuda --repeats 20 --json docs/results/bench/aegis-overhead-gpu.json
    python benchmarks/aegis_overhead.py --cpu-table    # docs/results/bench/aegis-overhead.json (section aegis-overhead)

`--cpu-table` is the docs' CPU table: transformer4, gpt-tiny and MiniLM at batch 16 x 48 on one
thread (a fully loaded machine) and on every core, then the transformer4 bench again REPEAT_RUNS
times REPEAT_GAP_S apart (this VM's speed drifts between runs). `python -m results`
renders both JSON files (sections aegis-overhead, aegis-overhead-gpu).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from veil.defenses import create_defense
from veil.io import write_checked_text
from veil.models import create_model
from veil.training.loop import make_optimizer
from veil.training.step import client_step

VARIANTS: dict[str, list[tuple[str, dict[str, Any]]]] = {
    "none": [],
    "aegis": [("aegis", {})],
    "aegis-published": [("aegis", {"mlp_down_noise": 0.0})],
    "dpsgd": [("dpsgd", {"clip": 1.0, "noise_multiplier": 1.0})],
}


def steady_allocator() -> bool:
    """Keep freed large blocks in the heap (glibc mallopt), for every variant alike.

    By default glibc maps each block above its threshold freshly and unmaps it on free, so every
    step pays page faults on the ~12 MB gradient / clone / noise tables — and which step pays
    depends on the allocator's history: on transformer4 the AEGIS / none ratio swung from 0.98
    to 1.42 between identical runs (measured). With the blocks kept, it was 1.18-1.20 in eight
    runs: the cost of the computation, not of the allocator. Returns whether it applied.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
        return bool(libc.mallopt(M_MMAP_THRESHOLD, 1 << 30)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 1 << 30))
    except (OSError, AttributeError):
        return False


def make_batch(vocab: int, batch: int, length: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1000, vocab, (batch, length), generator=g)
    ids[:, 0], ids[:, -1] = 101, 102
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "labels": torch.randint(0, 2, (batch,), generator=g),
    }


def bench(
    model_name: str,
    batch: int,
    length: int,
    repeats: int,
    variants: list[str],
    model_kw: dict[str, Any] | None = None,
    device: str = "cpu",
) -> dict[str, Any]:
    steady = steady_allocator()
    dev = torch.device(device)
    setups = {}
    for name in variants:
        torch.manual_seed(0)
        model = create_model(model_name, **(model_kw or {})).to(dev)
        defenses = [create_defense(d, **kw).attach(model) for d, kw in VARIANTS[name]]
        setups[name] = (model, defenses, make_optimizer(model, 1e-5, 0.0))
    vocab = next(iter(setups.values()))[0].token_embedding().weight.shape[0]
    b = {k: v.to(dev) for k, v in make_batch(vocab, batch, length).items()}
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    times: dict[str, list[float]] = {n: [] for n in variants}
    order = list(setups.items())
    for r in range(repeats + 1):  # the first round warms up; every other round runs in reverse
        for name, (model, defenses, opt) in order if r % 2 else order[::-1]:
            sync()
            t0 = time.perf_counter()
            client_step(model, b, defenses, opt, step=r, clip=1.0)
            sync()
            if r:
                times[name].append(time.perf_counter() - t0)
    med = {n: statistics.median(t) for n, t in times.items()}
    return {
        "model": model_name,
        "batch": batch,
        "len": length,
        "repeats": repeats,
        "threads": torch.get_num_threads(),
        "device": str(dev) if dev.type == "cpu" else torch.cuda.get_device_name(dev),
        "median_s": med,
        "ratio_to_none": {n: med[n] / med["none"] for n in med},
        "steady_allocator": steady,
    }


#: the accelerator suite: veil's encoder and decoder, and MiniLM-L6's shapes (HF BERT from a config, random
#: init: the step time does not depend on the weights, and the pretrained files stay off the accelerator machine)
SUITE: list[tuple[str, dict[str, Any], list[str]]] = [
    ("transformer4", {}, ["none", "aegis", "dpsgd"]),
    ("gpt-tiny", {}, ["none", "aegis", "aegis-published", "dpsgd"]),
    ("hf-bert", {"dim": 384, "depth": 6, "heads": 12, "max_len": 512, "dropout": 0.0}, ["none", "aegis", "dpsgd"]),
]


def suite(device: str, shapes: list[tuple[int, int]], repeats: int) -> list[dict[str, Any]]:
    """Every SUITE model at every (batch, length)."""
    out = []
    for name, kw, variants in SUITE:
        for batch, length in shapes:
            res = bench(name, batch, length, repeats, variants, kw, device)
            print(
                json.dumps({"model": name, "batch": batch, "len": length, "ratio_to_none": res["ratio_to_none"]}),
                flush=True,
            )
            out.append({**res, "model_kw": kw})
    return out


#: the transformer4 bench repeated on every core, REPEAT_GAP_S apart (--cpu-table)
REPEAT_RUNS, REPEAT_GAP_S = 8, 15.0
CPU_TABLE = [
    ("transformer4", 20, ["none", "aegis", "dpsgd"]),
    ("gpt-tiny", 10, ["none", "aegis", "aegis-published", "dpsgd"]),
]
CPU_TABLE += [("minilm", 6, ["none", "aegis", "dpsgd"])]
BENCH_DIR = Path(__file__).resolve().parents[1] / "docs" / "results" / "bench"


def cpu_table() -> dict[str, Any]:
    """The docs' CPU table: every CPU_TABLE model on one thread, then on every core; the repeats."""
    rows = []
    for threads in sorted({1, os.cpu_count() or 1}):
        torch.set_num_threads(threads)
        rows += [bench(m, 16, 48, n, variants) for m, n, variants in CPU_TABLE]
    torch.set_num_threads(os.cpu_count() or 1)
    repeats = []
    for i in range(REPEAT_RUNS):
        time.sleep(REPEAT_GAP_S * (i > 0))
        repeats.append(bench("transformer4", 16, 48, 20, ["none", "aegis"]))
    return {"rows": rows, "repeats": repeats, "gap_s": REPEAT_GAP_S, "load": os.getloadavg()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="transformer4")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--len", type=int, default=48)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--variants", default="none,aegis,aegis-published,dpsgd")
    p.add_argument("--device", default="cpu")
    p.add_argument("--suite", action="store_true", help="every SUITE model at batch 16 x 48 and 64 x 128 (a JSON list)")
    p.add_argument("--json", default=None)
    p.add_argument(
        "--cpu-table", action="store_true", help="the docs' CPU table, into docs/results/bench/aegis-overhead.json"
    )
    a = p.parse_args()
    if a.cpu_table:
        write_checked_text(BENCH_DIR / "aegis-overhead.json", json.dumps(cpu_table(), indent=1) + "\n")
        print(f"wrote {BENCH_DIR / 'aegis-overhead.json'}; render with python -m results")
        return
    if a.suite:
        res: Any = suite(a.device, [(16, 48), (64, 128)], a.repeats)
    else:
        res = bench(a.model, a.batch, a.len, a.repeats, a.variants.split(","), device=a.device)
    print(json.dumps(res, indent=2))
    if a.json:
        write_checked_text(Path(a.json), json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
