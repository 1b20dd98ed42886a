"""The span attack's tail over many random draws: seconds per batch and recovery, batch by batch.

Drives the code path of the user's command, `veil attack CONFIG model.dropout=0 --attack span
--batch-size B --samples N` (`veil.commands.attack`: the same target, thread setting, private
batches, seeds and attack call), and records what that command averages away: per batch the wall
and CPU seconds (the process' own time: one process using both cores for 60 s = 120 CPU s), the
token and exact-sentence recovery, the work in both budget units (`SpanAttack.budget`: sentences
scored and block-rows) and whether the budget stopped the search. Each batch is appended to a
JSON-lines file as it finishes (`--rows`), so a killed run resumes where it stopped, and N processes
side by side (`--part K/N`) share the file; a run without `--part` then summarises it.

    python benchmarks/span_tail.py --batch-size 4 --samples 64 [--seed 0] [key=value ...] [--write]
    python benchmarks/span_tail.py --batch-size 16 --samples 4 --name span-mean16 model.pooling=mean
    python benchmarks/span_tail.py --config configs/scale/gpt2_small_sst2.yaml --batch-size 16 --samples 8 \
        --seed 1 --name NAME --json docs/results/bench/span-decoder.json --section span-decoder --write train.threads=1

Results: docs/results/bench/NAME.json (hashed as the results book reads it; key = the cell), and
with `--write` the `span-tail` section of docs/results.md (`results/sections/span_tail.py`; `--section`
names another, e.g. `span-decoder`, rendered by `results/sections/span_decoder.py` from its `--json`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CONFIG = "configs/minilm_sst2.yaml"


def quantile(xs: list[float], q: float) -> float:
    """The q-quantile of `xs` (linear between order statistics)."""
    s = sorted(xs)
    k = (len(s) - 1) * q
    lo = int(k)
    return s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (k - lo)


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The measured batches in the JSON-lines file, the first row of each index (processes side by
    side may measure one twice)."""
    rows: dict[int, dict[str, Any]] = {}
    for line in path.read_text().splitlines() if path.is_file() else []:
        if line.strip():
            r = json.loads(line)
            rows.setdefault(r["index"], r)
    return list(rows.values())


def run_rows(args: argparse.Namespace, rows_path: Path) -> list[dict[str, Any]]:
    """Attack each drawn batch as `veil attack` does; rows already in `rows_path` are kept."""
    import torch

    from veil.attacks import create_attack
    from veil.attacks.harness import attack_once, private_batches, score
    from veil.commands.attack import load_target, split_overrides
    from veil.runtime import use_threads

    done = read_rows(rows_path)
    have = {r["index"] for r in done}
    part, parts = (int(x) for x in args.part.split("/"))
    mine = {i for i in range(args.samples) if i % parts == part}
    if args.indices:  # a range A-B of its own (processes added beside running parts)
        lo, hi = (int(x) for x in args.indices.split("-"))
        mine = set(range(lo, hi + 1)) & set(range(args.samples))
    if have >= mine:  # every batch measured: nothing to load
        return sorted((r for r in done if r["index"] < args.samples), key=lambda r: r["index"])
    cfg_over, settings = split_overrides(args.overrides)
    model, data, defenses, cfg, _ = load_target(str(ROOT / args.config), cfg_over)
    use_threads(cfg.train.threads)
    attack = create_attack("span", **settings)
    reason = attack.applies(model, args.batch_size, "single-step")
    if reason:
        sys.exit(f"not applicable: {reason}")
    for i, batch in enumerate(private_batches(data.test, args.batch_size, args.samples, args.seed)):
        if i in have or i not in mine:
            continue
        torch.manual_seed(args.seed + i)
        c0, w0 = time.process_time(), time.perf_counter()
        rec, ref, _ = attack_once(attack, model, batch, defenses, data, "original", args.seed + i)
        cpu, wall = time.process_time() - c0, time.perf_counter() - w0
        m = score(rec, ref, data)
        st = rec.stats
        row = {
            "index": i,
            "tokens": int(batch["attention_mask"].sum()),
            "token_recovery": float(m["token_recovery"]),
            "exact_recovery": float(m["exact_recovery"]),
            "wall_s": round(wall, 2),
            "cpu_s": round(cpu, 2),
            "threads": torch.get_num_threads(),
            "load": round(os.getloadavg()[0], 1),
            "work": st.get("work", {}),
            "budget_stopped": bool(st.get("budget_stopped")),
            "sentences_exact": st.get("sentences_exact"),
            "search": st.get("search"),
        }
        with rows_path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        done.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    return sorted(done, key=lambda r: r["index"])


def config_flag(args: argparse.Namespace) -> str:
    """` --config PATH` where the run's config is not the default one, else nothing."""
    return f" --config {args.config}" if args.config != CONFIG else ""


def summarise(rows: list[dict[str, Any]], args: argparse.Namespace, budget: dict[str, int]) -> dict[str, Any]:
    """The cell: the command, its draws, seconds (p50 / p95 / max) and recovery (mean, spread)."""
    wall, cpu = [r["wall_s"] for r in rows], [r["cpu_s"] for r in rows]
    tok, ex = [r["token_recovery"] for r in rows], [r["exact_recovery"] for r in rows]
    over = " ".join(args.overrides)
    return {
        "command": f"python benchmarks/span_tail.py --batch-size {args.batch_size} --samples {args.samples} "
        f"--seed {args.seed}{config_flag(args)} {' '.join(args.overrides[1:])}".strip(),
        "cli": f"veil attack {args.config} {over} --attack span --batch-size {args.batch_size} "
        f"--samples {args.samples} --seed {args.seed} --out OUT".replace("  ", " "),
        "batch": args.batch_size,
        "samples": len(rows),
        "planned": args.samples,
        "indices": [r["index"] for r in rows],
        "budget": budget,
        "wall_p50": quantile(wall, 0.5),
        "wall_p95": quantile(wall, 0.95),
        "wall_max": max(wall),
        "cpu_p50": quantile(cpu, 0.5),
        "cpu_p95": quantile(cpu, 0.95),
        "cpu_max": max(cpu),
        "token_recovery": statistics.fmean(tok),
        "token_recovery_sd": statistics.pstdev(tok),
        "token_recovery_min": min(tok),
        "exact_recovery": statistics.fmean(ex),
        "budget_stopped": sum(r["budget_stopped"] for r in rows),
        "over_300_s": sum(w > 300 for w in wall),
        "load": [min(r["load"] for r in rows), max(r["load"] for r in rows)],
        "threads": sorted({r["threads"] for r in rows}),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "per_batch": rows,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=CONFIG)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--name", default="", help="the cell's key (default bB-nN, plus the overrides)")
    ap.add_argument("--json", default=str(ROOT / "docs/results/bench/span-tail.json"))
    ap.add_argument("--rows", default="", help="the per-batch JSON-lines file (default /tmp/span_tail_NAME.jsonl)")
    ap.add_argument(
        "--part", default="0/1", help="K/N: measure the batches i with i %% N == K (N processes side by side)"
    )
    ap.add_argument("--indices", default="", help="A-B: measure these batches (with --part K/N: summarise nothing)")
    ap.add_argument("--note", default="", help="what the cell's code differs in (rendered beside it)")
    ap.add_argument("--report", action="store_true", help="measure nothing: summarise the batches in --rows so far")
    ap.add_argument("--write", action="store_true", help="splice the section (--section) into docs/results.md")
    ap.add_argument("--section", default="span-tail", help="the section --write splices (results/sections/NAME.py)")
    ap.add_argument("--compare", default="", help="a cell of the same JSON to set this one's CPU s against per draw")
    ap.add_argument("overrides", nargs="*", help="config key=value and attack.KEY=VALUE, as veil attack takes them")
    args = ap.parse_args()
    args.overrides = ["model.dropout=0", *args.overrides]
    name = args.name or "-".join([f"b{args.batch_size}", f"n{args.samples}", *args.overrides[1:]])
    rows_path = Path(args.rows or f"/tmp/span_tail_{name.replace('/', '_')}.jsonl")
    rows = sorted(read_rows(rows_path), key=lambda r: r["index"]) if args.report else run_rows(args, rows_path)
    if (
        args.part != "0/1" or args.indices
    ):  # one part of several: its rows are in the file; a run without --part summarises
        return

    from veil.attacks import create_attack
    from veil.commands.attack import split_overrides

    o = create_attack("span", **split_overrides(args.overrides)[1]).options
    budget = {"sentences_scored": o.sentences(args.batch_size), "block_rows": o.work * args.batch_size}  # per batch
    cell = summarise(rows, args, budget)
    if args.note:
        cell["note"] = args.note
    if args.compare:
        cell["compare"] = args.compare
    print(json.dumps({k: v for k, v in cell.items() if k != "per_batch"}, indent=1))
    sys.path.insert(0, str(ROOT))
    from veil.io import write_checked_text

    path = Path(args.json)
    doc = json.loads(path.read_text()) if path.is_file() else {}
    doc[name] = cell
    path.parent.mkdir(parents=True, exist_ok=True)
    write_checked_text(path, json.dumps(doc, indent=1) + "\n")
    if args.write:
        from importlib import import_module

        from results import splice
        from veil.io import atomic_write_text

        render = import_module(f"results.sections.{args.section.replace('-', '_')}").render
        docs = ROOT / "docs" / "results.md"
        atomic_write_text(docs, splice(docs.read_text(), args.section, render(doc).strip()))


if __name__ == "__main__":
    main()
