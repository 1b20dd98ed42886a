"""Federated learning on Flower: FedAvg / FedSGD / FedProx rounds, the defended exported update,
the live privacy auditor, client failures and exact resume. Fast tests use the in-process grid
(real Flower messages, serialised); the Ray simulation engine runs in the slow ones."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import FED_TINY as TINY
from helpers import events, fed_config, kill_server_after_round
from veil.errors import VeilError
from veil.federated.fedavg.task import load_spec


def write_cfg(tmp: Path) -> Path:
    return fed_config(tmp, "clients: 2, rounds: 2, partition: dirichlet, alpha: 0.5, local_steps: 2")


def fed(tmp: Path, *overrides: str, out: str = "run", resume: bool = False) -> dict:
    from veil.federated.fedavg.runner import federate

    spec = load_spec(write_cfg(tmp), [*TINY, *overrides])
    return federate(spec, tmp / out, resume=resume)


def test_fedavg_round_trip_writes_run_folder(tmp_path: Path) -> None:
    s = fed(tmp_path, "federated.audit=[april]")
    run = tmp_path / "run"
    assert s["rounds"] == 2 and 0.0 <= s["test_accuracy"] <= 1.0 and s["client_failures"] == 0
    ev = events(run)
    rounds = [e for e in ev if e["event"] == "round"]
    assert [e["round"] for e in rounds] == [1, 2] and all(e["replies"] == 2 and e["bytes_up"] > 0 for e in rounds)
    audits = [e for e in ev if e["event"] == "audit"]
    assert audits and {"round", "client", "attack", "psnr", "ssim", "verified"} <= set(audits[0])
    assert all(e["verified"] for e in audits)  # the oracle re-derived exactly the batch the client used
    assert "april" in s["leakage"] and (run / "leakage.png").stat().st_size > 1000
    assert (run / "checkpoints" / "model.safetensors").is_file()
    assert fed(tmp_path, "federated.audit=[april]") == s  # a finished run returns its summary


def test_fedsgd_audit_april_rebuilds_batch_of_one(tmp_path: Path) -> None:
    """FedSGD at batch 1: the update is the raw gradient, APRIL's closed form recovers the image."""
    s = fed(
        tmp_path,
        "federated.mode=fedsgd",
        "train.batch_size=1",
        "federated.rounds=1",
        "federated.audit=[april]",
        "federated.audit_clients=2",
        "model.dim=32",
    )
    audits = [e for e in events(tmp_path / "run") if e["event"] == "audit"]
    assert len(audits) == 2 and all(e["verified"] and e["psnr"] > 30 for e in audits), audits
    assert s["leakage"]["april"]["psnr"] > 30


def _fedsgd_reply(tmp_path: Path, *overrides: str):
    """(spec, world, global arrays, the weights client 1 was sent, its reply's gradient) for round 3."""
    from flwr.app import ConfigRecord, Message, RecordDict

    from veil.federated.fedavg.client_app import app
    from veil.federated.fedavg.task import client_world, model_arrays, reset_defenses
    from veil.federated.grid import LocalGrid

    spec = load_spec(
        write_cfg(tmp_path), [*TINY, "federated.mode=fedsgd", "defense=gaussian", "defense.sigma=0.5", *overrides]
    )
    world = client_world(spec.text())
    reset_defenses(world)
    arrays = model_arrays(world.model)
    msg = Message(
        RecordDict({"arrays": arrays, "config": ConfigRecord({"spec": spec.text(), "lr": 0.01, "server-round": 3})}),
        dst_node_id=1002,
        message_type="train",
    )
    reply = list(LocalGrid(app, 2).send_and_receive([msg], timeout=60))[0]
    return spec, world, arrays, reply.content["arrays"].to_torch_state_dict()


def _recompute(spec, world, arrays, secret: int | None, torch_seed: int):
    """Client 1's round-3 step recomputed with the given defense secret and torch seed: (defended, clean) gradients."""
    from veil.federated.fedavg.task import client_split, local_batches, reset_defenses, step_key
    from veil.training.step import client_step

    reset_defenses(world)
    for d in world.defenses:
        d.secret = secret
    world.model.load_state_dict(arrays.to_torch_state_dict())
    batch = next(local_batches(client_split(world, 1), 16, 0, 3, 1, 1, 1))
    torch.manual_seed(torch_seed)
    res = client_step(world.model, batch, world.defenses, None, step=step_key(3, 1, 0), clip=spec.cfg.train.clip)
    return res.grads, client_step(world.model, batch, [], None, clip=spec.cfg.train.clip).grads


def test_exported_update_is_what_the_defense_produced(tmp_path: Path) -> None:
    """The fedsgd reply carries exactly client_step's defended gradient (Gaussian noise here)."""
    from veil.federated.client_secret import round_secret
    from veil.federated.fedavg.task import round_seed

    spec, world, arrays, sent = _fedsgd_reply(tmp_path, "federated.secret=seeded")
    mine, clean = _recompute(spec, world, arrays, round_secret("seeded", 0, 3, 1), round_seed(0, 3, 1))
    assert set(sent) == set(mine)
    assert all(torch.equal(sent[k], mine[k]) for k in sent)
    assert not torch.allclose(sent["head.weight"], clean["head.weight"])  # the noise is in what was sent


@pytest.mark.parametrize("mode", ["random", "seeded"])
def test_server_cannot_regenerate_a_clients_noise_unless_secrets_are_seeded(tmp_path: Path, mode: str) -> None:
    """The server knows the spec (seed included), the round, the client and the weights: with the
    default client-held secret its best regeneration of the noise misses by the noise's own size;
    with `federated.secret: seeded` it regenerates the noise exactly and strips it."""
    from veil.federated.client_secret import round_secret
    from veil.federated.fedavg.task import round_seed

    spec, world, arrays, sent = _fedsgd_reply(tmp_path, f"federated.secret={mode}")
    from veil.federated.client_secret import process_secret

    assert str(process_secret()) not in spec.text() and str(process_secret() % 2**64) not in spec.text()
    guess, clean = _recompute(spec, world, arrays, round_secret("seeded", 0, 3, 1), round_seed(0, 3, 1))
    miss = torch.cat([(sent[k] - guess[k]).flatten() for k in sent]).norm()
    noise = torch.cat([(sent[k] - clean[k]).flatten() for k in sent]).norm()
    if mode == "seeded":
        assert miss == 0
    else:
        assert miss > 1.2 * noise  # two independent draws: ~sqrt(2) x the noise, nothing cancelled
    secrets_ = {round_secret("random", 0, r, p) for r in (1, 2) for p in (0, 1)}
    assert len(secrets_) == 4 and all(s.bit_length() > 100 for s in secrets_)


def test_client_that_raises_does_not_stop_the_run(tmp_path: Path) -> None:
    s = fed(tmp_path, "federated.fail={client: 1, round: 1, mode: raise}")
    ev = events(tmp_path / "run")
    fail = [e for e in ev if e["event"] == "client_failure"]
    assert len(fail) == 1 and fail[0]["round"] == 1 and fail[0]["client"] == 1 and "injected" in fail[0]["reason"]
    assert [e["replies"] for e in ev if e["event"] == "round"] == [1, 2] and s["rounds"] == 2


def test_client_that_times_out_is_dropped_from_the_round(tmp_path: Path) -> None:
    fed(tmp_path, "federated.fail={client: 0, round: 2, mode: hang, seconds: 4}", "federated.timeout=1.5")
    ev = events(tmp_path / "run")
    fail = [e for e in ev if e["event"] == "client_failure"]
    assert len(fail) == 1 and fail[0]["round"] == 2 and "timeout" in fail[0]["reason"]


def test_server_killed_after_round_k_resumes_to_identical_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Exact resume needs the clients' randomness seeded (`federated.secret: seeded`)."""

    run = ["federated.rounds=3", "federated.fraction=0.5", "federated.secret=seeded"]
    full = fed(tmp_path, *run, out="full")
    undo = kill_server_after_round(monkeypatch, 2)
    with pytest.raises(KeyboardInterrupt):
        fed(tmp_path, *run, out="cut")
    undo()
    with pytest.raises(VeilError, match="--resume"):
        fed(tmp_path, *run, out="cut")
    resumed = fed(tmp_path, *run, out="cut", resume=True)
    a = load_file(str(tmp_path / "full" / "checkpoints" / "model.safetensors"))
    b = load_file(str(tmp_path / "cut" / "checkpoints" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert resumed["test_accuracy"] == full["test_accuracy"]
    assert [e["round"] for e in events(tmp_path / "cut") if e["event"] == "round"] == [1, 2, 3]


def test_fedprox_sends_mu_and_pulls_towards_global(tmp_path: Path) -> None:
    from veil.federated.fedavg.task import ProximalTerm, client_world

    world = client_world(load_spec(write_cfg(tmp_path), TINY).text())
    prox = ProximalTerm(0.0, world.model)
    assert prox.aux_loss(world.model, {}, torch.zeros(1)) is None  # mu = 0: plain FedAvg
    with torch.no_grad():
        world.model.head.weight.add_(1.0)
    term = ProximalTerm(2.0, world.model)
    with torch.no_grad():
        world.model.head.weight.add_(0.5)
    assert float(term.aux_loss(world.model, {}, torch.zeros(1))) == pytest.approx(
        0.5 * 2.0 * 0.25 * world.model.head.weight.numel(), rel=1e-4
    )
    s = fed(tmp_path, "federated.strategy=fedprox", "federated.proximal_mu=0.1", "federated.rounds=1")
    assert s["strategy"] == "fedprox" and s["rounds"] == 1


def test_bad_federated_key_is_one_line_error(tmp_path: Path) -> None:
    with pytest.raises(VeilError, match="unknown config key 'federated.clientz'"):
        load_spec(write_cfg(tmp_path), ["federated.clientz=3"])
    with pytest.raises(VeilError, match="federated.mode must be one of"):
        load_spec(write_cfg(tmp_path), ["federated.mode=fedsomething"])
    from veil.cli import main

    assert main(["federate", str(write_cfg(tmp_path)), "federated.partition=zipf", "--out", str(tmp_path / "x")]) == 2


def test_federated_evaluate_handler(tmp_path: Path) -> None:
    from flwr.app import ConfigRecord, Message, RecordDict

    from veil.federated.fedavg.client_app import app
    from veil.federated.fedavg.task import client_world, model_arrays
    from veil.federated.grid import LocalGrid

    spec = load_spec(write_cfg(tmp_path), TINY)
    arrays = model_arrays(client_world(spec.text()).model)
    grid = LocalGrid(app, 2)
    msgs = [
        Message(
            RecordDict({"arrays": arrays, "config": ConfigRecord({"spec": spec.text()})}),
            dst_node_id=n,
            message_type="evaluate",
        )
        for n in grid.get_node_ids()
    ]
    replies = list(grid.send_and_receive(msgs, timeout=60))
    assert sum(int(r.content["metrics"]["num-examples"]) for r in replies) == 100
    assert all(0 <= r.content["metrics"]["test_accuracy"] <= 1 for r in replies)


# ---- Flower's simulation engine (Ray) -----------------------------------------------------------
def _veil(*args: str) -> subprocess.Popen:
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0"}
    return subprocess.Popen(
        [sys.executable, "-m", "veil.cli", *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


@pytest.mark.slow
def test_ray_client_killed_mid_round_and_server_killed_then_resumed(tmp_path: Path) -> None:
    """Ray: a client process dies (os._exit) in round 2, the run goes on; the server process is
    SIGKILLed after round 2 and `--resume` ends with the weights of an uninterrupted run."""
    cfg = write_cfg(tmp_path)
    common = [
        *TINY,
        "federated.backend=ray",
        "federated.rounds=4",
        "federated.clients=3",
        "federated.timeout=60",
        "federated.secret=seeded",
    ]
    full = _veil("federate", str(cfg), *common, "--out", str(tmp_path / "full"), "--quiet")
    assert full.wait(600) == 0, full.stdout.read()
    cut = _veil("federate", str(cfg), *common, "--out", str(tmp_path / "cut"), "--quiet")
    state = tmp_path / "cut" / "checkpoints" / "state.json"
    end = time.time() + 600  # a safety net for a run that never checkpoints, not the check
    while time.time() < end and not (state.is_file() and json.loads(state.read_text())["round"] >= 2):
        time.sleep(0.2)
    os.kill(cut.pid, signal.SIGKILL)
    cut.wait()
    res = _veil("federate", str(cfg), *common, "--out", str(tmp_path / "cut"), "--resume", "--quiet")
    assert res.wait(600) == 0, res.stdout.read()
    a = load_file(str(tmp_path / "full" / "checkpoints" / "model.safetensors"))
    b = load_file(str(tmp_path / "cut" / "checkpoints" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    dead = _veil(
        "federate",
        str(cfg),
        *common,
        "federated.fail={client: 2, round: 2, mode: exit}",
        "--out",
        str(tmp_path / "dead"),
        "--quiet",
    )
    assert dead.wait(600) == 0, dead.stdout.read()
    ev = events(tmp_path / "dead")
    assert any(e["event"] == "client_failure" and e["round"] == 2 and e["client"] == 2 for e in ev)
    assert [e["round"] for e in ev if e["event"] == "round"] == [1, 2, 3, 4]
