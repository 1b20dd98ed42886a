"""Section gpu renders the GPU run beside the same benchmark's CPU cells (matched by model and batch)."""

from __future__ import annotations

from results.sections import gpu


def _cell(model: str, batch: int, rec: float, s: float, stopped: bool) -> dict:
    head = dict(model=model, batch=batch, budget=100_000, tokens=218.0, rank1=171.0, token_recovery=rec)
    return head | dict(exact_recovery=rec, wall_s=s, cpu_s=s, sentences_scored=10.0, budget_stopped=stopped, samples=1)


def test_the_gpu_table_pairs_each_cell_with_its_cpu_run() -> None:
    g = {
        "date": "2026-12-04",
        "gpu": "NVIDIA H200",
        "torch": "2.11",
        "transformers": "5.17",
        "tests": "6 passed",
        "span": {
            "commands": ["python benchmarks/span_scale.py"],
            "cells": [_cell("minilm", 8, 1.0, 8.2, False), _cell("minilm", 64, 0.001, 1.5, True)],
        },
        "ig": {"veil_it_s": 30.0, "breaching_it_s": 12.0, "veil_psnr": 9.9, "breaching_psnr": 9.8, "runs": 2}
        | {"april": {"veil": {"seconds": 0.006, "psnr": 99.0}, "breaching": {"seconds": 0.024, "psnr": 9.2}}},
        "aegis": [
            {"model": "hf-bert", "batch": 16, "len": 48, "median_s": {"none": 0.02, "aegis": 0.019}}
            | {"ratio_to_none": {"none": 1.0, "aegis": 0.95}}
        ],
    }
    cpu = {"scale": {"cells": [_cell("minilm", 8, 1.0, 122.0, False)]}}
    text = gpu.render({"bench/gpu": g, "bench/span-scale": cpu})
    rows = [line for line in text.splitlines() if line.startswith("| span")]
    assert rows[0].endswith(
        "| token 1.000, exact 1.00, 8.2 s | token 1.000, exact 1.00, 122.0 CPU s (budget 100,000) |"
    )
    assert "budget spent | not run |" in rows[1]
    assert "veil 30.00 it/s, breaching 12.00 it/s: **2.50x**" in text
    assert "| step time vs none | hf-bert, batch 16 x 48 tokens | aegis 0.95x (none 20.0 ms) | not run |" in text
