"""FedAvg with many clients (issue 21; the measured 100 / 500-client runs are
benchmarks/flower_scale.py): 100 clients, 10 a round, on the in-process grid at a tiny size; the
live auditor attacks at most `federated.audit_clients` of a round's clients, however many reply."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from veil.federated.fedavg.task import load_spec

TINY = [
    "model.dim=16",
    "model.depth=1",
    "model.heads=2",
    "data.train_size=400",
    "data.test_size=60",
    "train.batch_size=8",
    "federated.backend=inline",
    "federated.partition=iid",
    "federated.rounds=1",
    "federated.local_steps=1",
]


def test_100_clients_10_a_round_complete_and_the_auditor_stays_bounded(tmp_path: Path) -> None:
    from veil.federated.fedavg.runner import federate

    torch.set_num_threads(1)
    p = tmp_path / "fed.yaml"
    p.write_text("model: {name: vit-digits}\ndata: {name: digits}\ntrain: {seed: 0}\nfederated: {clients: 100}\n")
    spec = load_spec(p, [*TINY, "federated.fraction=0.1", "federated.audit=[labels]", "federated.audit_clients=2"])
    summary = federate(spec, tmp_path / "run")
    events = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if x]
    rounds = [e for e in events if e["event"] == "round"]
    audits = [e for e in events if e["event"] == "audit"]
    assert [(e["clients"], e["replies"]) for e in rounds] == [(10, 10)]
    assert summary["clients"] == 100 and summary["client_failures"] == 0
    assert len(audits) == 2 and len({e["client"] for e in audits}) == 2  # 2 of the 10 updates, not 10
