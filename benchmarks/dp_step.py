"""Step time of DP-SGD on MiniLM-L6 (issue 17): veil's DP-SGD in each mode against Opacus itself.

One run, interleaved (each round times one optimiser step of every variant on the same batch, in
reversed order every other round), medians, ratios to the undefended step:

- ``none``: undefended step (veil's client_step, AdamW);
- ``veil-ghost`` / ``veil-hooks`` / ``veil-functorch``: veil's `dpsgd` (``mode=...``), noise 1, clip 1;
- ``opacus-ghost``: Opacus' own ghost clipping (GradSampleModuleFastGradientClipping +
  DPOptimizerFastGradientClipping + DPLossFastGradientClipping, as ``PrivacyEngine`` wires them);
- ``opacus-hooks``: Opacus' GradSampleModule + DPOptimizer.

Opacus' hooks cannot see the position and segment tables MiniLM reads as slices, and Opacus'
optimiser rejects a trainable parameter without per-sample gradient (BERT's pooler, unused under
mean pooling), so every DP variant trains all parameters but those three (veil's explicit ghost /
hooks freeze the two tables themselves); veil-functorch trains the same set, like for like.

    python benchmarks/dp_step.py --batch 16 --len 32 --repeats 10 --json runs/dp/bench.json
    python benchmarks/dp_step.py --write     # docs/results/bench/dp-step.json (section dp of docs/results.md)

`python -m results` renders the JSON `--write` leaves (with its hash) in section dp.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from aegis_overhead import make_batch, steady_allocator  # noqa: E402

from veil.defenses.dpsgd import DPSGD  # noqa: E402
from veil.defenses.dpsgd_engines import per_sample_loss  # noqa: E402
from veil.io import write_checked_text  # noqa: E402
from veil.models import create_model  # noqa: E402
from veil.training.loop import make_optimizer  # noqa: E402
from veil.training.step import client_step  # noqa: E402

RAW = r"position_embeddings|token_type_embeddings|pooler"
TRAINABLE = r"^(?!.*(" + RAW + r"))"  # all but the two raw-read tables and the unused pooler
VARIANTS = ["none", "veil-ghost", "opacus-ghost", "veil-hooks", "opacus-hooks", "veil-functorch"]
BENCH = Path(__file__).resolve().parents[1] / "docs" / "results" / "bench" / "dp-step.json"


def _model() -> nn.Module:
    torch.manual_seed(0)
    return create_model("minilm", dropout=0.1, pooling="mean").train()


def _veil(mode: str | None) -> Callable[[dict, int], None]:
    model = _model()
    defenses = (
        [DPSGD(clip=1.0, noise_multiplier=1.0, mode=mode, trainable=TRAINABLE, chunk=64).attach(model)] if mode else []
    )
    opt = make_optimizer(model, 1e-5, 0.0)
    return lambda b, r: client_step(model, b, defenses, opt, step=r, clip=1.0, export=False)


def _opacus(ghost: bool, batch: int) -> Callable[[dict, int], None]:
    from opacus.grad_sample import GradSampleModule
    from opacus.grad_sample.grad_sample_module_fast_gradient_clipping import GradSampleModuleFastGradientClipping
    from opacus.optimizers import DPOptimizer, DPOptimizerFastGradientClipping
    from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

    model = _model()
    for n, p in model.named_parameters():
        p.requires_grad_(not any(k in n for k in RAW.split("|")))
    base = make_optimizer(model, 1e-5, 0.0)
    kw = dict(noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=batch)
    if ghost:
        gsm = GradSampleModuleFastGradientClipping(model, max_grad_norm=1.0, use_ghost_clipping=True, strict=False)
        opt = DPOptimizerFastGradientClipping(base, **kw)
        crit = DPLossFastGradientClipping(gsm, opt, nn.CrossEntropyLoss(), "mean")

        def step(b: dict, r: int) -> None:
            opt.zero_grad()
            crit(gsm(b), b["labels"]).backward()
            opt.step()
    else:
        gsm = GradSampleModule(model, strict=False)
        opt = DPOptimizer(base, **kw)

        def step(b: dict, r: int) -> None:
            opt.zero_grad()
            per_sample_loss(model, gsm(b), b).mean().backward()
            opt.step()

    return step


def bench(batch: int, length: int, repeats: int, variants: list[str]) -> dict[str, Any]:
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    steady = steady_allocator()
    build = {
        "none": lambda: _veil(None),
        "veil-ghost": lambda: _veil("ghost"),
        "veil-hooks": lambda: _veil("hooks"),
        "veil-functorch": lambda: _veil("functorch"),
        "opacus-ghost": lambda: _opacus(True, batch),
        "opacus-hooks": lambda: _opacus(False, batch),
    }
    steps = {v: build[v]() for v in variants}
    b = make_batch(30522, batch, length)
    times: dict[str, list[float]] = {v: [] for v in variants}
    order = list(steps.items())
    for r in range(repeats + 1):  # round 0 warms up
        for name, fn in order if r % 2 else order[::-1]:
            t0 = time.perf_counter()
            fn(b, r)
            if r:
                times[name].append(time.perf_counter() - t0)
    med = {v: statistics.median(t) for v, t in times.items()}
    ref = med.get("none")
    return {
        "model": "minilm",
        "batch": batch,
        "len": length,
        "repeats": repeats,
        "threads": torch.get_num_threads(),
        "steady_allocator": steady,
        "median_s": med,
        "ratio_to_none": {v: m / ref for v, m in med.items()} if ref else None,
        "veil_ghost_over_opacus_ghost": med["veil-ghost"] / med["opacus-ghost"]
        if {"veil-ghost", "opacus-ghost"} <= set(med)
        else None,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--len", type=int, default=32)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--json")
    p.add_argument("--write", action="store_true", help=f"write the JSON to {BENCH.relative_to(BENCH.parents[3])}")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    res = bench(args.batch, args.len, args.repeats, args.variants.split(","))
    print(json.dumps(res, indent=1))
    for path in ([Path(args.json)] if args.json else []) + ([BENCH] if args.write else []):
        path.parent.mkdir(parents=True, exist_ok=True)
        write_checked_text(path, json.dumps(res, indent=1) + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
