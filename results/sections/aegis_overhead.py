"""Section aegis-overhead: the step time of AEGIS and DP-SGD against an undefended step on this
machine's CPU, from `python benchmarks/aegis_overhead.py --cpu-table` (a timing benchmark, not an
audit: docs/results/bench/aegis-overhead.json). Ratios are measured in one run, variants
interleaved; absolute times are indicative only."""

from __future__ import annotations

from typing import Any

from results.tables import table

SOURCES = ("bench/aegis-overhead",)


def bench_table(b: dict[str, Any]) -> str:
    """One model's medians and ratios (`benchmarks/aegis_overhead.bench`'s JSON)."""
    where = f"on {b['device']}" if b.get("device", "cpu") != "cpu" else f"{b['threads']} threads"
    rows = [[n, f"{b['median_s'][n]:.3f}", f"{b['ratio_to_none'][n]:.2f}"] for n in b["median_s"]]
    head = (
        f"{b['model']}, batch {b['batch']} x {b['len']} tokens, median of {b['repeats']} interleaved steps ({where}):"
    )
    return head + "\n\n" + table(["variant", "median step (s)", "ratio to none"], rows)


def repeats_table(reps: list[dict[str, Any]], gap: float) -> str:
    ratios = [r["ratio_to_none"]["aegis"] for r in reps]
    rows = [
        [i + 1, f"{1e3 * r['median_s']['none']:.1f}", f"{1e3 * r['median_s']['aegis']:.1f}"]
        + [f"{r['ratio_to_none']['aegis']:.2f}"]
        for i, r in enumerate(reps)
    ]
    return (
        f"transformer4 on all {reps[0]['threads']} threads, the same bench run {len(reps)} times {gap:.0f} s apart. "
        "This VM's two-core speed drifts between runs (the undefended step below); the random bits of AEGIS's draw "
        "are made on one core, so its share grows when the rest of the step gets faster. Ratio over the runs: "
        f"{min(ratios):.2f}-{max(ratios):.2f}.\n\n"
        + table(["run", "none median (ms)", "aegis median (ms)", "ratio to none"], rows)
    )


def render(r: dict[str, Any]) -> str:
    parts = [
        "### Step time (goal: AEGIS <= 1.15 x none)",
        "",
        "`python benchmarks/aegis_overhead.py --cpu-table`, glibc told to keep freed large blocks (`steady_allocator`: "
        "without it, page faults on freshly mapped gradient tables swung the transformer4 ratio from 0.98 to 1.42 "
        "between identical runs). AEGIS's own cost is one Gaussian draw per entry of the vocabulary-sized tables "
        "(token embedding, and an untied LM head): fixed per step, so it weighs most on a narrow model with a small "
        "batch. The draw (`veil.defenses.noise`) makes its bits on one core (SFC64) and runs Box-Muller, the noise "
        "scales and the adds as one torch.compile graph on every core torch uses; each model is timed on one thread "
        "(a fully loaded machine) and on all of this machine's cores. The first AEGIS step of a process compiles "
        f"that graph (not timed: every variant's first step is a warm-up). One-minute load at the end: {r['load'][0]:.1f}.",
        "",
    ]
    parts += [bench_table(b) + "\n" for b in r["rows"]]
    parts += [repeats_table(r["repeats"], r["gap_s"])]
    return "\n".join(parts)
