"""The span attack on LoRA updates (issue 38): rank r = 8 / 32 / 256 on a GPT-2 shape (HF GPT-2,
Conv1D c_attn adapted with fan_in_fan_out) and a LLaMA shape (llama-tiny: RoPE, SwiGLU), at
batch 1 / 4 / 8 of SST-2 test sentences (GLUE dev) of up to 32 WordPiece tokens, one client step
per private batch at the base's initial weights (B = 0), scored by `veil attack`'s scorer.

The client fine-tunes with `train.lora: {r: R}` (adapters on q, k, v, o, MLP up and down; base
and token embedding frozen), so the update holds the adapters' gradients only; the attack tests
candidate layer inputs x by their projections A x against the row spaces of the exported dL/dB
(`veil.attacks.span.lora`). Each adapter's span has rank <= min(n, r) for the n tokens that reach
the loss, so the test has a gap only while n < r: per cell, the mean tokens per batch, the mean
rank of the first layer's adapter spans, and how many batches had every adapter span full
(rank r) are reported beside the recovery.

    python benchmarks/lora_span.py [--models hf-gpt2,llama-tiny] [--ranks 8,32,256] [--batches 1,4,8]
        [--samples 4] [--budget 50000] [--max-len 32] [--short-len 8] [--threads 1] [--write]

`--short-len`: the smallest r again at every batch on the same draw cut to that many tokens (a
sentence of 8 tokens has 7 that reach the loss: below r = 8 at batch 1).

Results go to docs/results/bench/lora-span.json (hashed); `--write` splices the `lora-span`
section of docs/results.md, rendered by `results.sections.lora_span` from that JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import torch

from veil.attacks import create_attack
from veil.attacks.harness import attack_once, private_batches, score
from veil.build import build_run
from veil.config import load_config

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the results book (`results/`) is a repository folder, not an installed package
MODELS: dict[str, list[str]] = {
    "hf-gpt2": ["model=hf-gpt2", "model.dropout=0", "model.dim=256", "model.depth=2"],
    "llama-tiny": ["model=llama-tiny"],
}


def cell(name: str, r: int, B: int, samples: int, budget: int, max_len: int) -> dict[str, Any]:
    """Mean over `samples` private test batches of batch size B (seeded draw, as `veil attack`)."""
    over = [*MODELS[name], "data=sst2", f"data.max_len={max_len}", "data.train_size=64", f"train.lora.r={r}"]
    model, data, defenses = build_run(load_config(None, over))
    attack = create_attack("span", budget=budget)
    rows = []
    for i, batch in enumerate(private_batches(data.test, B, samples, seed=0)):
        torch.manual_seed(i)
        c0, w0 = time.process_time(), time.perf_counter()
        rec, ref, _ = attack_once(attack, model, batch, defenses, data, "original", i)
        cpu, wall = time.process_time() - c0, time.perf_counter() - w0
        m = score(rec, ref, data)
        st = rec.stats
        rows.append(
            {
                "tokens": int(batch["attention_mask"].sum()),
                "adapter_rank": sum(st["adapter_ranks"]) / len(st["adapter_ranks"]),
                "full_rank": bool(st["full_rank"]),
                "token_recovery": float(m["token_recovery"]),
                "exact_recovery": float(m["exact_recovery"]),
                "wall_s": wall,
                "cpu_s": cpu,
                "sentences_scored": int(st["work"].get("sentences_scored", 0)),
                "budget_stopped": bool(st["budget_stopped"]),
            }
        )
        print(f"  {name} r={r} B={B} #{i}: {json.dumps(rows[-1])}", file=sys.stderr, flush=True)
    mean = {
        k: sum(x[k] for x in rows) / len(rows)
        for k in ("token_recovery", "exact_recovery", "wall_s", "cpu_s", "tokens", "adapter_rank")
    }
    return {
        "model": name,
        "width": int(model.width),
        "max_len": max_len,
        "r": r,
        "batch": B,
        "samples": len(rows),
        "budget": budget,
        **mean,
        "full_rank": sum(x["full_rank"] for x in rows),
        "budget_stopped": sum(x["budget_stopped"] for x in rows),
        "exact_batches": sum(x["exact_recovery"] == 1.0 for x in rows),
        "per_sample": rows,
    }


def save(value: dict[str, Any], path: Path) -> dict[str, Any]:
    from veil.io import write_checked_text

    path.parent.mkdir(parents=True, exist_ok=True)
    write_checked_text(path, json.dumps(value, indent=1) + "\n")
    return value


def write_docs(doc: dict[str, Any]) -> None:
    """Splice the lora-span section (rendered from the JSON) into docs/results.md."""
    from results import splice
    from results.sections.lora_span import render
    from veil.io import atomic_write_text

    DOC = ROOT / "docs" / "results.md"
    atomic_write_text(DOC, splice(DOC.read_text(), "lora-span", render(doc).strip()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="hf-gpt2,llama-tiny")
    ap.add_argument("--ranks", default="8,32,256")
    ap.add_argument("--batches", default="1,4,8")
    ap.add_argument("--samples", type=int, default=4, help="private test batches per cell")
    ap.add_argument("--budget", type=int, default=50_000, help="span search budget (sentences scored)")
    ap.add_argument("--max-len", type=int, default=32)
    ap.add_argument(
        "--short-len", type=int, default=8, help="also the smallest r at each batch on sentences cut to this (0: off)"
    )
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=str(ROOT / "docs/results/bench/lora-span.json"), help="the collected JSON")
    ap.add_argument("--write", action="store_true", help="splice the lora-span section into docs/results.md")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cells = [
        cell(name, int(r), int(b), args.samples, args.budget, args.max_len)
        for name in args.models.split(",")
        for r in args.ranks.split(",")
        for b in args.batches.split(",")
    ]
    r_min = min(int(r) for r in args.ranks.split(","))
    if args.short_len:
        cells += [
            cell(name, r_min, int(b), args.samples, args.budget, args.short_len)
            for name in args.models.split(",")
            for b in args.batches.split(",")
        ]
    doc = {
        "cells": cells,
        "env": {
            "command": "python benchmarks/lora_span.py " + shlex.join(sys.argv[1:]),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "cpu": platform.processor() or platform.machine(),
            "max_len": args.max_len,
        },
    }
    path = Path(args.json)
    save(doc, path)
    if args.write:
        write_docs(doc)
    from results.sections.lora_span import render

    print(render(doc))


if __name__ == "__main__":
    main()
