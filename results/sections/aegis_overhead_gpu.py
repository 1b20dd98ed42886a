"""Section aegis-overhead-gpu: the AEGIS / DP-SGD step time on a lent GPU, from
`python benchmarks/aegis_overhead.py --suite --device cuda --repeats 20 --json
docs/results/bench/aegis-overhead-gpu.json` (run on an accelerator machine when one is lent; CI
never runs it)."""

from __future__ import annotations

from typing import Any

from results.sections.aegis_overhead import bench_table

SOURCES = ("bench/aegis-overhead-gpu",)


def render(rows: list[dict[str, Any]]) -> str:
    parts = [
        "### Step time on a GPU",
        "",
        "`python benchmarks/aegis_overhead.py --suite --device cuda --repeats 20 --json "
        "docs/results/bench/aegis-overhead-gpu.json`, run on a machine lent for one session (not this one; CI never "
        "runs it). `hf-bert` has MiniLM-L6's shapes (384 wide, 6 layers, 12 heads) at random init: the step time does "
        "not depend on the weights. Steps this small are bound by kernel launches on a GPU, where the noise draw "
        "(cuRAND) is cheap.",
        "",
    ]
    return "\n".join(parts + [bench_table(b) + "\n" for b in rows]).rstrip()
