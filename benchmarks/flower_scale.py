"""Flower simulation at scale (issue 21): veil's FedAvg on ViT digits with 100 and 500 clients.

    python benchmarks/flower_scale.py [--clients 100 500] [--rounds 5] [--fraction 0.1] [--write]
    python benchmarks/flower_scale.py --from OUT/results.json --write   # re-render a measured run

Each run is `veil federate`'s own code path (`veil.federated.fedavg.runner.federate`, Flower's
simulation engine on Ray, one CPU per virtual client), configs/fedavg_deploy_digits.yaml with
federated.clients=N, fraction 0.1 (N/10 clients a round), iid partition, 5 rounds, and the live
auditor running the `labels` attack on at most `federated.audit_clients` (2) clients a round.

Per round it reports
  wall       the round's seconds as the server logs them (sampling, messages, training, auditing,
             aggregation, central evaluation on the 360 test images)
  local      the sum over the round's clients of their local training time (`train-seconds`,
             which each client measures around its `train_round` and reports in its reply)
  overhead   wall - local / p, with p = min(clients in the round, Ray's concurrency = cores /
             num_cpus): what the round costs beyond its local compute spread over the workers
  audit      the auditor's own seconds (its events' `seconds`), part of the overhead
and for the run: the start-up before round 1 (Ray, the SuperNodes, the membership query of every
client), the peak memory of the whole process tree (the driver with the ServerApp, Ray's raylet,
GCS and workers: summed RSS and summed PSS, sampled every 0.25 s), and the partition sizes.

The partition: `iid` cuts a seeded shuffle of the 1,437 training images into N parts whose sizes
differ by at most one (`veil.data.partition.iid`): 14-15 images a client at 100, 2-3 at 500, so
at 500 a client's round is one batch of 2-3 images (batch size 32). `dirichlet` would redraw
until every client holds 2 images and stop with one line if 1,000 draws cannot.

`--write` regenerates the backend's marked section of docs/federated.md (`flower-scale` for inline,
`flower-scale-ray` for Ray) from the measured numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "fedavg_deploy_digits.yaml"
DOC = ROOT / "docs" / "federated.md"


def markers(backend: str) -> tuple[str, str]:
    """The doc section each backend's table lives in: `flower-scale` (inline, the first measured
    here) and `flower-scale-ray`, so one backend's run never replaces the other's table."""
    name = "flower-scale" if backend == "inline" else f"flower-scale-{backend}"
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


def tree_memory(root: int) -> tuple[int, int]:
    """(summed RSS, summed PSS) in bytes of `root` and all its descendants, from /proc."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(d.name))
    rss = pss = 0
    todo = [root]
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Rss:"):
                    rss += int(line.split()[1]) * 1024
                elif line.startswith("Pss:"):
                    pss += int(line.split()[1]) * 1024
        except OSError:
            continue
    return rss, pss


class Peak:
    """Samples the process tree's memory in a thread; keeps the peaks."""

    def __init__(self, every: float = 0.25) -> None:
        self.rss = self.pss = 0
        self.every, self.stop = every, threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        while not self.stop.is_set():
            rss, pss = tree_memory(os.getpid())
            self.rss, self.pss = max(self.rss, rss), max(self.pss, pss)
            self.stop.wait(self.every)

    def __enter__(self) -> Peak:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        self.thread.join()


def run_one(
    clients: int, rounds: int, fraction: float, out: Path, timeout: float = 600.0, backend: str = "ray"
) -> dict[str, Any]:
    import torch

    from veil.federated.fedavg import server_app
    from veil.federated.fedavg.runner import federate
    from veil.federated.fedavg.task import load_spec

    torch.set_num_threads(1)
    overrides = [
        f"federated.clients={clients}",
        f"federated.fraction={fraction}",
        f"federated.rounds={rounds}",
        "federated.partition=iid",
        f"federated.backend={backend}",
        "federated.num_cpus=1",
        "federated.audit=[labels]",
        "federated.audit_clients=2",
        f"federated.timeout={timeout}",
    ]
    spec = load_spec(CONFIG, overrides)
    local: list[list[float]] = []
    real_exchange = server_app.exchange

    def exchange(grid: Any, messages: Any, timeout: float, *a: Any, **k: Any) -> list[Any]:
        replies = real_exchange(grid, messages, timeout, *a, **k)
        local.append([float(m.content["metrics"]["train-seconds"]) for m in replies if not m.has_error()])
        return replies

    server_app.exchange = exchange  # only the round loop's exchange (the membership queries have their own)
    t0 = time.perf_counter()
    try:
        with Peak() as peak:
            summary = federate(spec, out)
    finally:
        server_app.exchange = real_exchange
    total = time.perf_counter() - t0
    events = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x]
    rows = [e for e in events if e["event"] == "round"]
    workers = max(1, int((os.cpu_count() or 1) // spec.fed.num_cpus)) if backend == "ray" else 1
    per_round = []
    for e, secs in zip(rows, local):
        audit = sum(float(a.get("seconds", 0.0)) for a in events if a["event"] == "audit" and a["round"] == e["round"])
        p = min(len(secs), workers) or 1
        per_round.append(
            {
                "round": e["round"],
                "clients": e["clients"],
                "replies": e["replies"],
                "wall": e["seconds"],
                "local": round(sum(secs), 3),
                "overhead": round(e["seconds"] - sum(secs) / p, 3),
                "audit": round(audit, 3),
                "audited": sum(a["event"] == "audit" and a["round"] == e["round"] for a in events),
                "test_accuracy": e["test_accuracy"],
            }
        )
    from veil.build import build_data
    from veil.federated.fedavg.task import partitions

    sizes = [len(p) for p in partitions(build_data(spec.cfg), spec.fed, spec.cfg.train.seed)]
    return {
        "backend": backend,
        "clients": clients,
        "per_round_clients": rows[0]["clients"] if rows else 0,
        "rounds": per_round,
        "startup": round(total - sum(e["seconds"] for e in rows), 1),
        "total": round(total, 1),
        "workers": workers,
        "peak_rss_mib": round(peak.rss / 2**20),
        "peak_pss_mib": round(peak.pss / 2**20),
        "partition_sizes": {"min": min(sizes), "median": statistics.median(sizes), "max": max(sizes)},
        "test_accuracy": summary["test_accuracy"],
    }


def table(results: list[dict[str, Any]], load: str) -> str:
    backend = results[0].get("backend", "ray")
    engine = (
        f"Flower's simulation engine, {results[0]['workers']} Ray workers of one CPU"
        if backend == "ray"
        else "`federated.backend=inline`: Flower's messages on the in-process grid, one client at a time"
    )
    flag = "" if backend == "ray" else " --backend inline"
    lines = [
        f"Measured by `python benchmarks/flower_scale.py{flag} --write` ({load}; {engine}). Seconds per round; "
        "overhead = wall - local / min(clients in the round, workers); "
        "the auditor (`labels` on at most 2 clients a round) is part of the overhead.",
        "",
        "| clients | round | sampled | replies | wall s | local s (sum) | overhead s | auditor s (clients) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        for x in r["rounds"]:
            lines.append(
                f"| {r['clients']} | {x['round']} | {x['clients']} | {x['replies']} | {x['wall']:.2f} | {x['local']:.2f} | "
                f"{x['overhead']:.2f} | {x['audit']:.2f} ({x['audited']}) |"
            )
    lines += [
        "",
        "| clients | images per client (min / median / max) | start-up s | whole run s | peak memory of the process tree (RSS / PSS MiB) | final accuracy |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for r in results:
        s = r["partition_sizes"]
        lines.append(
            f"| {r['clients']} | {s['min']} / {s['median']:g} / {s['max']} | {r['startup']:.1f} | {r['total']:.1f} | "
            f"{r['peak_rss_mib']} / {r['peak_pss_mib']} | {r['test_accuracy']:.4f} |"
        )
    return "\n".join(lines)


def write_doc(text: str, backend: str) -> None:
    BEGIN, END = markers(backend)
    doc = DOC.read_text()
    if BEGIN not in doc or END not in doc:
        raise SystemExit(f"{DOC} has no {BEGIN} ... {END} section")
    head, rest = doc.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    DOC.write_text(f"{head}{BEGIN}\n{text}\n{END}{tail}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, nargs="+", default=[100, 500])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--fraction", type=float, default=0.1)
    p.add_argument(
        "--timeout", type=float, default=3000.0, help="federated.timeout: the wait for every client's first answer too"
    )
    p.add_argument(
        "--backend", choices=("ray", "inline"), default="ray", help="federated.backend (inline: one process, no Ray)"
    )
    p.add_argument("--out", type=Path, default=None, help="run folders (default: a temporary folder)")
    p.add_argument("--write", action="store_true", help="regenerate the marked section of docs/federated.md")
    p.add_argument("--from", dest="source", type=Path, help="render this results.json instead of measuring")
    a = p.parse_args(argv)
    if a.source is not None:
        saved = json.loads(a.source.read_text())
        text = table(saved["results"], saved["load"])
        print(text)
        if a.write:
            write_doc(text, saved["results"][0].get("backend", "ray"))
        return 0
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    base = a.out or Path(tempfile.mkdtemp(prefix="flower-scale-"))
    load_before = os.getloadavg()
    results = []
    for n in a.clients:
        r = run_one(n, a.rounds, a.fraction, base / f"clients{n}", a.timeout, a.backend)
        print(json.dumps(r), flush=True)
        results.append(r)
    load_after = os.getloadavg()
    load = f"load average {load_before[0]:.1f} before, {load_after[0]:.1f} after, 1-minute"
    text = table(results, load)
    print(text)
    (base / "results.json").write_text(json.dumps({"load": load, "results": results}, indent=2))
    if a.write:
        write_doc(text, a.backend)
    return 0


if __name__ == "__main__":
    sys.exit(main())
