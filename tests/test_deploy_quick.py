"""The deployment end to end, small enough for the default suite: a real SuperLink and two warm
SuperNodes on 127.0.0.1, each with its own image folder, one FedAvg round of a tiny ViT, the
server's run folder, and nothing left running afterwards."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from veil.build import build_data
from veil.federated.cluster import LocalCluster
from veil.federated.fedavg.silo import export_silos
from veil.federated.fedavg.task import load_spec

ROOT = Path(__file__).resolve().parent.parent
APP = ROOT / "scripts" / "deploy" / "fedavg-app"
CONFIG = ROOT / "configs" / "fedavg_deploy_digits.yaml"
SMALL = "model.dim=16 model.depth=1 model.heads=2 data.test_size=60 federated.clients=2 federated.rounds=1"


def test_a_small_federation_runs_on_its_silos_and_leaves_nothing(tmp_path: Path) -> None:
    spec = load_spec(CONFIG, SMALL.split())
    data = build_data(spec.cfg)
    silos = export_silos(data, [np.arange(0, 80), np.arange(80, 160)], tmp_path / "silos")
    run = tmp_path / "run"
    with LocalCluster(tmp_path / "c") as c:
        c.superlink()
        for i, folder in enumerate(silos):
            c.supernode(i, f'partition-id={i} data-path="{folder}"')
        assert c.submit(APP, {"config": str(CONFIG), "run-dir": str(run), "overrides": SMALL}, timeout=600) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["rounds"] == 1 and summary["clients"] == 2 and summary["client_failures"] == 0
    ev = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x]
    assert [e["replies"] for e in ev if e["event"] == "round"] == [2]
    audit = [e for e in ev if e["event"] == "audit"]
    assert audit and (run / audit[0]["saved"][0]).is_file()  # no oracle: the reconstruction is kept
    assert not c.alive()
