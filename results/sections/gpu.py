"""Section gpu: issue 21's GPU table, from one run of `benchmarks/gpu_run.sh` on a lent GPU,
collected by `python benchmarks/gpu_table.py DIR...` into docs/results/bench/gpu.json: the span
attack at batch 8-64 (`benchmarks/span_scale.py --device cuda`), Inverting Gradients veil vs
breaching (`benchmarks/ig_vs_breaching.py --device cuda`) and the AEGIS / DP-SGD step time
(`benchmarks/aegis_overhead.py --suite --device cuda`), each beside the same benchmark on this
project's 2-core CPU machine where one was run (span-scale and aegis-overhead's JSON)."""

from __future__ import annotations

from typing import Any

from results.notes import notes
from results.tables import table

NOTES = notes(__name__)

SOURCES = ("bench/gpu", "bench/span-scale", "bench/aegis-overhead")
OPTIONAL = ("bench/span-scale", "bench/aegis-overhead")


def _recovery(c: dict[str, Any], seconds: str) -> str:
    spent = ", budget spent" if c.get("budget_stopped") else ""
    return f"token {c['token_recovery']:.3f}, exact {c['exact_recovery']:.2f}, {seconds}{spent}"


def span_rows(gpu: dict[str, Any], cpu: dict[str, Any] | None) -> list[list[str]]:
    """One row per (model, batch): the GPU cell, and the CPU cell of the same model and batch."""
    on_cpu = {(c["model"], c["batch"]): c for c in (cpu or {}).get("scale", {}).get("cells", [])}
    rows = []
    for c in gpu["cells"]:
        ref = on_cpu.get((c["model"], c["batch"]))
        where = f"batch {c['batch']} ({c['tokens']:.0f} tokens, layer-1 rank {c['rank1']:.0f}), budget {c['budget']:,}"
        cpu_text = "not run"
        if ref is not None:
            cpu_text = _recovery(ref, f"{ref['cpu_s']:.1f} CPU s") + f" (budget {ref.get('budget', 0):,})"
        rows.append([f"span, {c['model']}", where, _recovery(c, f"{c['wall_s']:.1f} s"), cpu_text])
    return rows


def ig_rows(ig: dict[str, Any]) -> list[list[str]]:
    ratio = ig["veil_it_s"] / ig["breaching_it_s"]
    a = ig["april"]
    return [
        [
            "Inverting Gradients, veil vs breaching",
            f"vit-tiny, 32x32x3, one LFW face, 200 iterations, median of {ig['runs']} interleaved runs each",
            f"veil {ig['veil_it_s']:.2f} it/s, breaching {ig['breaching_it_s']:.2f} it/s: **{ratio:.2f}x**; "
            f"PSNR {ig['veil_psnr']:.2f} vs {ig['breaching_psnr']:.2f} dB",
            "section ig-vs-breaching",
        ],
        [
            "APRIL, veil vs breaching",
            "the same face; each on its own model (breaching's needs its modified first block)",
            f"veil {a['veil']['seconds'] * 1e3:.1f} ms, {a['veil']['psnr']:.2f} dB; breaching "
            f"{a['breaching']['seconds'] * 1e3:.1f} ms, {a['breaching']['psnr']:.2f} dB",
            "section ig-vs-breaching",
        ],
    ]


def aegis_rows(rows: list[dict[str, Any]], cpu: dict[str, Any] | None) -> list[list[str]]:
    on_cpu = {(r["model"], r["batch"], r["len"]): r for r in (cpu or {}).get("rows", [])}

    def ratios(r: dict[str, Any]) -> str:
        return ", ".join(f"{n} {x:.2f}x" for n, x in r["ratio_to_none"].items() if n != "none")

    out = []
    for r in rows:
        ref = on_cpu.get((r["model"], r["batch"], r["len"]))
        cpu_text = f"{ratios(ref)} ({ref['threads']} thread(s))" if ref else "not run"
        gpu_text = f"{ratios(r)} (none {r['median_s']['none'] * 1e3:.1f} ms)"
        out.append(["step time vs none", f"{r['model']}, batch {r['batch']} x {r['len']} tokens", gpu_text, cpu_text])
    return out


def render(found: dict[str, Any]) -> str:
    g = found["bench/gpu"]
    rows = span_rows(g["span"], found.get("bench/span-scale"))
    rows += ig_rows(g["ig"]) if "ig" in g else []
    rows += aegis_rows(g.get("aegis", []), found.get("bench/aegis-overhead"))
    head = ["measurement", "setting", f"on the {g['gpu']}", "on 2 CPU cores (the same benchmark)"]
    cmds = "; ".join(f"`{c}`" for c in g["span"]["commands"])
    return "\n".join(
        [
            f"## On a GPU: span at scale, IG and APRIL speed, AEGIS step time ({g['gpu']}, {g['date']})",
            "",
            NOTES["HOW"].format(
                gpu=g["gpu"], torch=g["torch"], transformers=g["transformers"], tests=g["tests"], span=cmds
            ),
            "",
            table(head, rows),
            "",
            NOTES["READING"],
        ]
    )
