"""FedAvg deployed across silos: a real SuperLink and SuperNodes (python -m veil.federated.supernode)
as processes on 127.0.0.1 (free ports; every process killed in a finally), each SuperNode with its
own image folder. Speed against the simulation, a SuperNode killed and restarted mid-run, a
SuperLink killed and restarted on its database, failed runs exiting non-zero, no orphans."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from veil.build import build_data
from veil.federated.cluster import LocalCluster
from veil.federated.fedavg.silo import export_silos
from veil.federated.fedavg.task import load_spec, partitions

ROOT = Path(__file__).resolve().parent.parent
APP = ROOT / "scripts" / "deploy" / "fedavg-app"
CONFIG = ROOT / "configs" / "fedavg_deploy_digits.yaml"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def silos(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    spec = load_spec(CONFIG)
    data = build_data(spec.cfg)
    return export_silos(data, partitions(data, spec.fed, spec.cfg.train.seed), tmp_path_factory.mktemp("silos"))


def events(run: Path) -> list[dict]:
    return [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines() if ln]


def round_seconds(run: Path) -> list[float]:
    return [e["seconds"] for e in events(run) if e["event"] == "round"]


def start_nodes(c: LocalCluster, silos: list[Path], only: list[int] | None = None) -> None:
    for i in only if only is not None else range(len(silos)):
        c.supernode(i, f'partition-id={i} data-path="{silos[i]}"')


def wait_for(pred, timeout: float, what: str, run=None) -> None:  # type: ignore[no-untyped-def]
    end = time.time() + timeout  # a safety net for an event that never comes, not a speed check
    while time.time() < end:
        if pred():
            return
        if run is not None and run.poll() is not None:
            raise AssertionError(f"the run ended (exit {run.returncode}) before {what}")
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def test_deployment_rounds_cost_training_plus_transfer(tmp_path: Path, silos: list[Path]) -> None:
    """Same job (ViT digits, 3 silos, 4 rounds) as the simulation (Ray, the same config): every
    deployment round sends the same messages, each carrying the whole model, and no more bytes than
    the simulation's, so a round costs the training plus the transfer and nothing more (counted,
    not timed; the round times are printed for the reader)."""
    from veil.federated.fedavg.runner import federate

    torch.set_num_threads(1)
    federate(load_spec(CONFIG), tmp_path / "sim")
    sim = round_seconds(tmp_path / "sim")
    with LocalCluster(tmp_path / "c") as c:
        c.superlink()
        start_nodes(c, silos)
        assert c.submit(APP, {"config": str(CONFIG), "run-dir": str(tmp_path / "run")}) == 0
        left = c.alive()
    dep = round_seconds(tmp_path / "run")
    print(f"simulation rounds {sim} s, deployment rounds {dep} s")
    model = sum(
        t.numel() * t.element_size() for t in load_file(tmp_path / "run" / "checkpoints" / "model.safetensors").values()
    )
    sim_rounds, dep_rounds = (
        [e for e in events(r) if e["event"] == "round"] for r in (tmp_path / "sim", tmp_path / "run")
    )
    assert [e["round"] for e in dep_rounds] == [e["round"] for e in sim_rounds] == [1, 2, 3, 4]
    for s, d in zip(sim_rounds, dep_rounds):
        assert d["clients"] == d["replies"] == s["clients"] == s["replies"] == 3, (s, d)
        for way in ("bytes_down", "bytes_up"):  # the model to and from each client, framing no larger than Ray's
            assert 3 * model <= d[way] <= s[way], (way, model, s, d)
    assert left and not c.alive()  # the cluster ran, and nothing of it outlives it


def test_killed_supernode_rejoins_and_trains_its_silo(tmp_path: Path, silos: list[Path]) -> None:
    """SIGKILL one SuperNode while it trains round 2 (it hangs there), restart it: the round counts
    one failure, the restarted node gets its silo back and trains it in round 3."""
    run = tmp_path / "run"
    with LocalCluster(tmp_path / "c") as c:
        c.superlink()
        start_nodes(c, silos)
        rc = {
            "config": str(CONFIG),
            "run-dir": str(run),
            "overrides": "federated.timeout=25 'federated.fail={client: 1, round: 2, mode: hang, seconds: 600}'",
        }
        p = c.start_run(APP, rc)
        wait_for(lambda: (run / "metrics.jsonl").is_file() and round_seconds(run), 300, "round 1", p)
        time.sleep(2)  # round 2 is under way; silo 1 hangs in it
        c.kill("supernode1")
        start_nodes(c, silos, only=[1])
        assert p.wait(600) == 0
        ev = events(run)
    summary = json.loads((run / "summary.json").read_text())
    fails = [e for e in ev if e["event"] == "client_failure"]
    assert summary["client_failures"] == 1 and fails[0]["round"] == 2 and fails[0]["client"] == 1, fails
    assert any(e["event"] == "client_rejoin" and e["client"] == 1 and e["round"] == 3 for e in ev), ev
    rounds = {e["round"]: e for e in ev if e["event"] == "round"}
    assert rounds[2]["replies"] == 2 and rounds[3]["replies"] == 3 and rounds[4]["replies"] == 3
    assert not c.alive()


def test_superlink_restart_resumes_to_identical_weights(tmp_path: Path, silos: list[Path]) -> None:
    """The SuperLink is killed after round 2 and restarted on its --database: the SuperNodes stay
    (no re-registration), the killed `flwr run` exits non-zero, and the resubmitted run resumes from
    the checkpoint to the weights of an uninterrupted run, bit for bit."""
    ref, run = tmp_path / "ref", tmp_path / "run"
    with LocalCluster(tmp_path / "c") as c:
        db = tmp_path / "state.db"
        c.superlink(database=db)
        start_nodes(c, silos)
        assert c.submit(APP, {"config": str(CONFIG), "run-dir": str(ref)}) == 0
        nodes_before = c.flwr(["supernode", "list", "veil-trial", "--format", "json"]).stdout
        p = c.start_run(APP, {"config": str(CONFIG), "run-dir": str(run)})
        wait_for(
            lambda: (
                (run / "checkpoints" / "state.json").is_file()
                and json.loads((run / "checkpoints" / "state.json").read_text())["round"] >= 2
            ),
            300,
            "round 2",
        )
        c.kill("superlink")
        code = p.wait(120)
        c.procs.pop("flwr-run", None)
        assert code != 0 or json.loads((run / "status.json").read_text())["status"] != "finished"
        c.superlink(database=db)
        assert c.submit(APP, {"config": str(CONFIG), "run-dir": str(run)}) == 0
        nodes_after = c.flwr(["supernode", "list", "veil-trial", "--format", "json"]).stdout
        assert all(f"supernode{i}" in c.procs and c.procs[f"supernode{i}"].poll() is None for i in range(3))
    a, b = load_file(ref / "checkpoints" / "model.safetensors"), load_file(run / "checkpoints" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ids = lambda text: set(re.findall(r'"node[-_]id":\s*"?(\d+)', text))  # noqa: E731
    assert len(ids(nodes_before)) == 3 and ids(nodes_after) >= ids(nodes_before), (nodes_before, nodes_after)
    resumed = [e for e in events(run) if e["event"] == "round"]
    assert [e["round"] for e in resumed] == [1, 2, 3, 4]  # rounds 1-2 before the restart, 3-4 after
    assert not c.alive()


def test_failed_run_exits_non_zero(tmp_path: Path, silos: list[Path]) -> None:
    """A silo whose data-path is missing: the ServerApp stops with the node's one-line reason, and
    the submission exits non-zero (flwr run alone would exit 0)."""
    run = tmp_path / "run"
    with LocalCluster(tmp_path / "c") as c:
        c.superlink()
        start_nodes(c, silos, only=[0, 1])
        c.supernode(2, f'partition-id=2 data-path="{tmp_path / "nowhere"}"')
        assert c.submit(APP, {"config": str(CONFIG), "run-dir": str(run)}, timeout=300) != 0
    status = json.loads((run / "status.json").read_text())
    assert status["status"] == "failed" and "does not exist on this SuperNode" in status["reason"], status
    assert not c.alive()
