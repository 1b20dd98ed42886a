"""The span attack at scale (issue 21): MiniLM (dropout 0) and a GPT-style decoder at batch
8 / 16 / 32 / 64 of SST-2 test sentences (GLUE dev) of up to 32 WordPiece tokens, one client step
per private batch, scored by `veil attack`'s scorer.

Per (model, batch): token and exact-sentence recovery, wall and CPU seconds per batch (the process'
own CPU time: on a shared machine wall time is inflated by the other jobs, CPU time much less so;
one process at 100 % of both cores for 120 s = 240 CPU s), sentences scored, whether the budget
(counted work, `attack.budget`) stopped the search, and the work per CPU second. Where the attack
stops working is read off the layer-1 span (Petrov et al. 2024, DAGER, eq. 2-3: the rank of
``[dW_Q; dW_K; dW_V]`` of block 1 is <= the batch's real tokens B*T; once B*T reaches the width the
span is the whole space and layer 1 admits every token at every position): `--ranks` measures that
rank vs B*T for more batch sizes (one client step each, no search). `--signal` measures what is left
once those spans are full: each block's MLP down-projection W (width x 4 width) gets
``dL/dW = sum_i delta_i a_i^T``, whose row space (rank <= width) is the part of span{a_i} the
gradient keeps; per block, the mean over a sentence's positions of the relative distance of its
a_i to that row space, for the true sentence and with k of its tokens replaced by other tokens of
the batch (one client step per batch size; the medians over the batch's sentences).

    python benchmarks/span_scale.py [--models minilm,hf-gpt2] [--batches 8,16,32,64] [--samples 2]
        [--budget 200000] [--threads 1] [--device cpu|cuda|auto] [--write]
    python benchmarks/span_scale.py --cli-runs 2 --write      # issue 21's CLI command, 2 runs side by side
    python benchmarks/span_scale.py ... --out A.json           # one process per cell, side by side, then
    python benchmarks/span_scale.py --merge A.json,B.json --write
    python benchmarks/span_scale.py --signal 8,16,32 --write   # the MLP-down signal (below), no search

Results go to docs/results/bench/span-scale.json (keys `scale` and `cli`, hashed), the figure to
docs/figures/span_scale.png; `--write` splices the `span-scale` section of docs/results.md,
rendered by `results.sections.span_scale` from that JSON.
The decoder is HF GPT-2 at width 256, 2 layers, weights at init (docs/results.md's wider decoder):
the width, not the depth, sets where the rank condition fails. MiniLM is the real pretrained checkpoint with a
fresh head, [CLS] pooling (the builder's default; `--minilm-pooling mean` as configs/minilm_sst2.yaml).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from veil.attacks import create_attack, observe
from veil.attacks.harness import attack_once, private_batches, score
from veil.attacks.span.checks import row_span
from veil.attacks.span.core import layer_span, param_name, recording_inputs
from veil.build import build_run
from veil.config import load_config
from veil.models.base import linear_weight

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the results book (`results/`) is a repository folder, not an installed package
MODELS: dict[str, list[str]] = {
    "minilm": ["model=minilm", "model.dropout=0"],
    "hf-gpt2": ["model=hf-gpt2", "model.dropout=0", "model.dim=256", "model.depth=2"],
    "gpt-tiny": ["model=gpt-tiny", "model.dropout=0"],
}


def target(name: str, max_len: int, pooling: str) -> tuple[Any, Any, list, int]:
    over = [
        *MODELS[name],
        "data=sst2",
        "data.tokenizer=wordpiece",
        f"data.max_len={max_len}",
        "data.train_size=64",
    ]
    if name == "minilm":
        over.append(f"model.pooling={pooling}")
    model, data, defenses = build_run(load_config(None, over))
    return model, data, defenses, int(model.width)


def cell(
    name: str, model: Any, data: Any, defenses: list, B: int, samples: int, settings: dict, device: str
) -> dict[str, Any]:
    """Mean over `samples` private test batches of batch size B (seeded draw, as `veil attack`)."""
    attack = create_attack("span", **settings)
    rows = []
    for i, batch in enumerate(private_batches(data.test, B, samples, seed=0)):
        batch = {k: v.to(device) for k, v in batch.items()}
        torch.manual_seed(i)
        c0, w0 = time.process_time(), time.perf_counter()
        rec, ref, _ = attack_once(attack, model, batch, defenses, data, "original", i)
        cpu, wall = time.process_time() - c0, time.perf_counter() - w0
        m = score(rec, {k: v.cpu() for k, v in ref.items()}, data)
        st = rec.stats
        work = int(st["work"].get("sentences_scored", 0))
        rows.append(
            {
                "tokens": int(batch["attention_mask"].sum()),
                "rank1": int(st["rank1"]),
                "token_recovery": float(m["token_recovery"]),
                "exact_recovery": float(m["exact_recovery"]),
                "wall_s": wall,
                "cpu_s": cpu,
                "sentences_scored": work,
                "budget_stopped": bool(st["budget_stopped"]),
                "search": st.get("search", "decoder"),
                "sentences_exact": st.get("sentences_exact"),
            }
        )
        print(f"  {name} B={B} #{i}: {json.dumps(rows[-1])}", file=sys.stderr, flush=True)
    mean = {k: sum(r[k] for r in rows) / len(rows) for k in ("token_recovery", "exact_recovery", "wall_s", "cpu_s")}
    work = sum(r["sentences_scored"] for r in rows)
    return {
        "model": name,
        "batch": B,
        "samples": len(rows),
        "budget": settings.get("budget"),
        **mean,
        "max_cpu_s": max(r["cpu_s"] for r in rows),
        "tokens": sum(r["tokens"] for r in rows) / len(rows),
        "rank1": sum(r["rank1"] for r in rows) / len(rows),
        "sentences_scored": work / len(rows),
        "scored_per_cpu_s": work / max(1e-9, sum(r["cpu_s"] for r in rows)),
        "budget_stopped": sum(r["budget_stopped"] for r in rows),
        "threads": torch.get_num_threads(),
        "per_sample": rows,
    }


def ranks(model: Any, data: Any, defenses: list, batches: list[int], device: str) -> list[dict[str, int]]:
    """Ranks of the layer-1 and layer-2 spans vs the batch's real tokens (one client step per batch size, no search)."""
    out = []
    for B in batches:
        batch = {k: v.to(device) for k, v in private_batches(data.test, B, 1, seed=0)[0].items()}
        model.eval()
        obs = observe(model, batch, defenses)
        span, span2 = layer_span(obs, 0), layer_span(obs, 1)
        tokens = int(batch["attention_mask"].sum())
        out.append({"batch": B, "tokens": tokens, "rank1": span.rank, "rank2": span2.rank, "width": span.width})
        model.zero_grad(set_to_none=True)
    return out


def signal(model: Any, data: Any, defenses: list, batches: list[int], device: str, wrong=(0, 1, 2, 4, 8)) -> dict:
    """Per batch size: the MLP-down gradients' ranks per block and, per k wrong tokens, the median
    over sentences of each block's mean per-position distance (module docstring)."""
    downs = model.mlp_down()
    out = []
    for B in batches:
        batch = {k: v.to(device) for k, v in private_batches(data.test, B, 1, seed=0)[0].items()}
        model.eval()
        obs = observe(model, batch, defenses)
        spans = [row_span(linear_weight(m, obs.grads[param_name(model, m.weight)])) for m in downs]
        model.zero_grad(set_to_none=True)
        ids, mask = batch["input_ids"].cpu(), batch["attention_mask"].cpu()
        bag = ids[mask.bool()].unique().tolist()
        rng = random.Random(0)
        dist: dict[int, list[list[float]]] = {k: [] for k in wrong}
        for b in range(B):
            n = int(mask[b].sum())
            for k in (k for k in wrong if k <= n - 2):
                x = ids[b, :n].clone()
                for t in rng.sample(range(1, n - 1), k):  # [CLS] and [SEP] stay
                    x[t] = rng.choice([v for v in bag if v != int(x[t])])
                with torch.no_grad(), recording_inputs(downs) as seen:
                    model({"input_ids": x[None].to(device), "attention_mask": torch.ones_like(x[None]).to(device)})
                dist[k].append([float(sp.distance(seen[id(m)][0].double()).mean()) for sp, m in zip(spans, downs)])
        med = {str(k): [statistics.median(c) for c in zip(*v)] for k, v in dist.items() if v}
        out.append(
            {
                "batch": B,
                "tokens": int(mask.sum()),
                "ranks": [sp.rank for sp in spans],
                "width": spans[0].width,
                "median_distance": med,
            }
        )
        print(f"signal B={B}: {json.dumps(out[-1])}", file=sys.stderr, flush=True)
    return {"model": "minilm", "batches": out}


def figure(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 4), constrained_layout=True)
    for name in result["models"]:
        cells = [c for c in result["cells"] if c["model"] == name]
        if cells:
            b = [c["batch"] for c in cells]
            axes[0].plot(b, [c["token_recovery"] for c in cells], "o-", label=f"{name} token")
            axes[0].plot(b, [c["exact_recovery"] for c in cells], "s--", label=f"{name} exact")
            axes[1].plot(b, [c["cpu_s"] for c in cells], "o-", label=f"{name} CPU s")
            axes[1].plot(b, [c["wall_s"] for c in cells], "x:", label=f"{name} wall s")
        r = result["ranks"].get(name) or []
        if r:
            axes[2].plot(
                [x["tokens"] for x in r], [x["rank1"] for x in r], "o-", label=f"{name} rank (width {r[0]['width']})"
            )
            axes[2].axhline(r[0]["width"], ls=":", color="grey")
    axes[0].set(xlabel="batch size", ylabel="recovery", title="recovery vs batch", ylim=(-0.05, 1.05), xscale="log")
    axes[1].set(xlabel="batch size", ylabel="seconds per batch", title="time vs batch", xscale="log", yscale="log")
    axes[2].set(
        xlabel="real tokens in the batch (B*T)", ylabel="rank of the layer-1 span", title="layer-1 span rank vs width"
    )
    top = max([x["tokens"] for r in result["ranks"].values() for x in r] + [1])
    axes[2].plot([0, top], [0, top], color="lightgrey", lw=1, label="rank = B*T (every token's own direction)")
    for ax in axes:
        ax.legend(fontsize=7)
        if ax is not axes[2]:
            ax.set_xticks(result["batches"], [str(b) for b in result["batches"]])
            ax.minorticks_off()
    fig.savefig(path, dpi=110)
    plt.close(fig)


CLI = (
    "veil attack configs/minilm_sst2.yaml model.dropout=0 --attack span --batch-size 4 --samples 2 --out {out} --quiet"
)


def cli_runs(n: int, root: Path) -> list[dict[str, Any]]:
    """Issue 21's command, `n` times side by side (each its own process and --out): wall and CPU
    seconds of each process (getrusage of the child), its per-batch seconds, recovery and work."""
    import os
    import subprocess

    procs = []
    for k in range(n):
        out = root / f"cli{k}"
        if out.exists():
            import shutil

            shutil.rmtree(out)
        cmd = CLI.format(out=out).split()
        procs.append((out, time.perf_counter(), subprocess.Popen(cmd, cwd=ROOT)))
    runs = []
    for out, t0, p in procs:
        _, status, usage = os.wait4(p.pid, 0)
        wall = time.perf_counter() - t0
        s = json.loads((out / "summary.json").read_text())
        m, per = s["attacks"]["span"], s["runs"]["span"]["per_sample"]
        runs.append(
            {
                "exit": os.waitstatus_to_exitcode(status),
                "wall_s": wall,
                "cpu_s": usage.ru_utime + usage.ru_stime,
                "token_recovery": m["token_recovery"],
                "exact_recovery": m["exact_recovery"],
                "seconds_per_batch": [r.get("seconds") for r in per],
                "token_per_batch": [r.get("token_recovery") for r in per],
                "work_per_batch": [r.get("budget_used") for r in per],
                "load": load(),
            }
        )
        print(f"cli: {json.dumps(runs[-1])}", file=sys.stderr, flush=True)
    return runs


def load() -> str:
    return " ".join(f"{x:.1f}" for x in __import__("os").getloadavg())


def save(key: str, value: dict[str, Any], path: Path) -> dict[str, Any]:
    """Put `value` under `key` of the collected JSON (hashed as the results renderer expects)."""
    from veil.io import write_checked_text

    doc = json.loads(path.read_text()) if path.is_file() else {}
    doc[key] = value
    path.parent.mkdir(parents=True, exist_ok=True)
    write_checked_text(path, json.dumps(doc, indent=1) + "\n")
    return doc


def write_docs(doc: dict[str, Any]) -> None:
    """Splice the span-scale section (rendered from the JSON) into docs/results.md."""
    from results import splice
    from results.sections.span_scale import render
    from veil.io import atomic_write_text

    DOC = ROOT / "docs" / "results.md"
    atomic_write_text(DOC, splice(DOC.read_text(), "span-scale", render(doc).strip()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="minilm,hf-gpt2")
    ap.add_argument("--batches", default="8,16,32,64")
    ap.add_argument("--rank-batches", default="1,2,4,8,12,16,24,32,48,64")
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--max-len", type=int, default=32)
    ap.add_argument("--budget", type=int, default=200_000)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prefix-seeds", action="store_true", help="span option prefix_seeds (veil.attacks.span.prefix)")
    ap.add_argument("--device", default="cpu", help="cpu, cuda or auto (cuda when present)")
    ap.add_argument("--minilm-pooling", default="cls", choices=("cls", "mean"))
    ap.add_argument("--json", default=str(ROOT / "docs/results/bench/span-scale.json"), help="the collected JSON")
    ap.add_argument("--out", default="", help="this run's own JSON (runs side by side; --merge them)")
    ap.add_argument("--figure", default=str(ROOT / "docs/figures/span_scale.png"))
    ap.add_argument(
        "--cli-runs", type=int, default=0, help="run issue 21's CLI command N times side by side, then stop"
    )
    ap.add_argument("--merge", default="", help="comma-separated --out JSONs of runs made side by side, into --json")
    ap.add_argument("--write", action="store_true", help="splice the span-scale section into docs/results.md")
    ap.add_argument("--signal", default="", help="batch sizes: measure MiniLM's MLP-down signal (no search), then stop")
    args = ap.parse_args()
    path = Path(args.json)
    if args.signal:
        torch.set_num_threads(args.threads)
        model, data, defenses, _ = target("minilm", args.max_len, args.minilm_pooling)
        sig = signal(model, data, defenses, [int(b) for b in args.signal.split(",")], "cpu")
        sig["command"] = "python benchmarks/span_scale.py " + shlex.join(sys.argv[1:])
        doc = save("signal", sig, path)
    elif args.cli_runs:
        before = load()
        runs = cli_runs(args.cli_runs, ROOT / "runs/span_scale_cli")
        cmd = "python benchmarks/span_scale.py " + shlex.join(sys.argv[1:])
        doc = save("cli", {"command": cmd, "load_before": before, "runs": runs}, path)
    elif args.merge:  # runs made side by side (one process per cell)
        parts = [json.loads(Path(p).read_text()) for p in args.merge.split(",")]
        result = parts[0]
        result["commands"] = [c for r in parts for c in r.get("commands", [r["command"]])]
        result["models"] = list(dict.fromkeys(m for r in parts for m in r["models"]))
        result["batches"] = sorted({b for r in parts for b in r["batches"]})
        result["ranks"] = {k: v for r in parts for k, v in r["ranks"].items() if v}
        result["cells"] = sorted((c for r in parts for c in r["cells"]), key=lambda x: (x["model"], x["batch"]))
        result["samples"] = max(r["samples"] for r in parts)
        for k in ("load_before", "load_after"):
            result["env"][k] = "; ".join(r["env"].get(k, "?") for r in parts)
        result["env"]["machine"] = "; ".join(dict.fromkeys(r["env"]["machine"] for r in parts))
        doc = save("scale", result, path)
        figure(result, Path(args.figure))
    else:
        device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
        torch.set_num_threads(args.threads)
        batches = [int(b) for b in args.batches.split(",") if b]
        result: dict[str, Any] = {
            "command": "python benchmarks/span_scale.py " + shlex.join(sys.argv[1:]),
            "models": args.models.split(","),
            "batches": batches,
            "samples": args.samples,
            "max_len": args.max_len,
            "cells": [],
            "ranks": {},
            "env": {
                "machine": f"{platform.machine()}, {args.threads} torch thread(s), device {device}, torch {torch.__version__}",
                "load_before": load(),
            },
        }
        out = Path(args.out) if args.out else None
        for name in result["models"]:
            model, data, defenses, _ = target(name, args.max_len, args.minilm_pooling)
            model.to(device)
            if args.rank_batches:
                rb = [int(b) for b in args.rank_batches.split(",")]
                result["ranks"][name] = ranks(model, data, defenses, rb, device)
                print(f"{name} ranks: {result['ranks'][name]}", file=sys.stderr, flush=True)
            for B in batches:
                c = cell(
                    name,
                    model,
                    data,
                    defenses,
                    B,
                    args.samples,
                    {"budget": args.budget, **({"prefix_seeds": True} if args.prefix_seeds else {})},
                    device,
                )
                result["cells"].append(c)
                print(
                    f"{name} B={B}: token {c['token_recovery']:.3f} exact {c['exact_recovery']:.2f} "
                    f"cpu {c['cpu_s']:.1f}s wall {c['wall_s']:.1f}s load {load()}",
                    flush=True,
                )
                if out:
                    out.write_text(json.dumps(result, indent=1))
        result["env"]["load_after"] = load()
        if out:
            out.write_text(json.dumps(result, indent=1))
            return
        doc = save("scale", result, path)
        figure(result, Path(args.figure))
    if args.write:
        write_docs(doc)
    from results.sections.span_scale import render

    print(render(doc))


if __name__ == "__main__":
    main()
