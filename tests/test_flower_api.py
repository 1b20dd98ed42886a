"""`veil.flower.audited`: a stock Flower PyTorch app (tests/flower_stock_app: task.py, client_app.py,
server_app.py in the shape of Flower's quickstart-pytorch; its server changes by two marked lines)
writes a veil audit folder: per-round events with the threat model, reconstructions, report.html.
Unsupported attacks on a plain nn.Module are refused in one line."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from flwr.serverapp.strategy import FedAvg

from veil.errors import VeilError
from veil.flower import audited

APP = Path(__file__).parent / "flower_stock_app"


def audit_events(folder: Path) -> list[dict]:
    return [json.loads(ln) for ln in (folder / "metrics.jsonl").read_text().splitlines() if ln]


def test_the_stock_app_changes_by_two_lines() -> None:
    marked = [ln for ln in (APP / "server_app.py").read_text().splitlines() if ln.rstrip().endswith("# veil")]
    assert len(marked) == 2
    assert "veil" not in (APP / "client_app.py").read_text() and "veil" not in (APP / "task.py").read_text()


def test_a_plain_module_refuses_attacks_it_cannot_support_in_one_line() -> None:
    sys.path.insert(0, str(APP))
    from task import Net

    with pytest.raises(VeilError, match="does not support a plain nn.Module") as e:
        audited(FedAvg(), model=Net(), attacks=["april"], input_shape=(1, 8, 8))
    assert "\n" not in str(e.value)
    with pytest.raises(VeilError, match="need input_shape"):
        audited(FedAvg(), model=Net(), attacks=["ig"])
    with pytest.raises(VeilError, match="wraps a flwr.serverapp.strategy.Strategy"):
        audited(object(), model=Net())  # type: ignore[arg-type]


def test_stock_app_on_an_in_process_grid_writes_the_audit_folder(tmp_path: Path) -> None:
    """The stock ServerApp and ClientApp on veil's in-process Flower Grid (2 nodes, 2 rounds)."""
    from flwr.app import Context, RecordDict

    from veil.federated.grid import LocalGrid

    torch.set_num_threads(1)
    sys.path.insert(0, str(APP))
    import client_app
    import server_app

    grid = LocalGrid(client_app.app, 2)
    for ctx in grid.nodes.values():
        ctx.run_config.update({"batch-size": 4})
    cfg = {"num-server-rounds": 2, "lr": 0.1, "audit-dir": str(tmp_path / "audit")}
    server_app.main(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=cfg))
    check_folder(tmp_path / "audit")


def check_folder(out: Path) -> None:
    evs = audit_events(out)
    assert sorted({e["round"] for e in evs}) == [1, 2]
    labels = [e for e in evs if e["attack"] == "labels"]
    assert len(labels) == 4 and all(e["server_saw"] == "one client's update" for e in labels)
    # each partition is digits[pid::2][:4]: labels 0 2 4 6 and 1 3 5 7, read from the bias gradient
    assert {tuple(sorted(e["labels"])) for e in labels} == {(0, 2, 4, 6), (1, 3, 5, 7)}
    ig = [e for e in evs if e["attack"] == "ig"]
    assert len(ig) == 4 and all((out / e["saved"][0]).is_file() for e in ig)
    page = (out / "report.html").read_text()
    assert "Worst case per threat model" in page and "one client&#x27;s update" in page


@pytest.mark.slow
def test_stock_app_under_flwr_run_in_simulation(tmp_path: Path) -> None:
    app = tmp_path / "app"
    shutil.copytree(APP, app, ignore=shutil.ignore_patterns("__pycache__"))
    env = {**os.environ, "FLWR_HOME": str(tmp_path / "home"), "FLWR_TELEMETRY_ENABLED": "0"}
    done = subprocess.run(
        ["flwr", "run", str(app), "--stream", "--run-config", f'audit-dir="{tmp_path / "audit"}"'],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    check_folder(tmp_path / "audit")


@pytest.mark.slow
def test_stock_app_with_a_local_superlink_and_two_supernodes(tmp_path: Path) -> None:
    """Deployment: a real SuperLink and 2 SuperNodes on 127.0.0.1, `flwr run APP veil-trial`."""
    from veil.federated.cluster import LocalCluster

    app = tmp_path / "app"
    shutil.copytree(APP, app, ignore=shutil.ignore_patterns("__pycache__"))
    with LocalCluster(tmp_path / "c") as c:
        c.superlink()
        for i in range(2):
            c.supernode(i, f"partition-id={i} num-partitions=2")
        run = c.start_run(app, {"audit-dir": str(tmp_path / "audit")})
        code = run.wait(600)
    assert code == 0, (tmp_path / "c" / "flwr-run.log").read_text()[-3000:]
    check_folder(tmp_path / "audit")
