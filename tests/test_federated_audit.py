"""`veil audit` with `protocol: fedavg` / `protocol: split`: the live auditor's per-round leakage and
the split protocols' feature attacks land in the same summary / report as single-step tasks; a
killed federated audit resumes with identical numbers; bad protocols are one-line errors."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from veil.commands.audit import audit as run_audit  # the engine, then the report
from veil.errors import VeilError
from veil.experiments.audit import validate
from veil.experiments.scenario import parse_scenario
from veil.experiments.summary_schema import SCHEMA, summary_keys, task_keys

TINY_RUN = {
    "model": {"name": "vit-digits", "dim": 16, "depth": 1, "heads": 2},
    "data": {"name": "digits", "train_size": 240, "test_size": 100},
    "train": {"batch_size": 16, "lr": 0.003, "seed": 0},
}
FEDAVG = {
    "name": "fed",
    "seeds": [0],
    "tasks": [
        {
            "name": "avg",
            "protocol": "fedavg",
            "run": TINY_RUN,
            "defenses": ["none", {"name": "gaussian", "sigma": 0.1}],
            "attacks": ["april", {"name": "ig", "iterations": 3}, "labels"],
            "federated": {"clients": 2, "rounds": 2, "local_steps": 2, "audit_clients": 2},
        },
        {
            "name": "sgd",
            "protocol": "fedavg",
            "run": {
                **TINY_RUN,
                "model": {**TINY_RUN["model"], "dim": 32},
                "train": {"batch_size": 1, "lr": 0.003, "seed": 0, "clip": 0.0},
            },
            "attacks": ["april"],
            "federated": {"clients": 2, "rounds": 1, "mode": "fedsgd", "audit_clients": 1},
        },
    ],
}
SPLIT = {
    "name": "split",
    "seeds": [0],
    "tasks": [
        {
            "name": "sp",
            "protocol": "split",
            "run": {**TINY_RUN, "data": {"name": "digits"}, "train": {"batch_size": 64, "lr": 0.001, "seed": 0}},
            "defenses": ["sl", "pfesta", "fl"],
            "attacks": [
                {"name": "feature_inversion", "steps": 20},
                {"name": "feature_inversion", "unshuffle": False, "steps": 20},
            ],
            "federated": {"tasks": ["classify", "segment"], "clients_per_task": 1, "epochs": 1, "victims": 8},
        }
    ],
}
SIGMA, ROUNDS = 0.3, 10
TIMING = {"seconds", "iterations_per_second", "train_seconds", "train_seconds_mean"}


def untimed(x: Any) -> Any:
    """`x` without wall-clock fields (the only numbers a rerun may change)."""
    if isinstance(x, dict):
        return {k: untimed(v) for k, v in x.items() if k not in TIMING}
    if isinstance(x, list):
        return [untimed(v) for v in x]
    return x


def test_fedavg_audit_reports_per_round_leakage_and_worst_case(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    s = run_audit(parse_scenario(copy.deepcopy(FEDAVG)), tmp_path / "out", progress=False)
    t = s["tasks"]["avg"]
    assert s["schema"] == SCHEMA and set(s) <= summary_keys() and set(t) <= task_keys()  # typed, versioned
    assert t["protocol"] == "fedavg" and set(t["rounds"]) == {"none", "gaussian(sigma=0.1)"}
    assert (
        "fedsgd" in t["skipped"]["april"]
    )  # APRIL's closed form does not model a multi-step update: not applicable, with the reason
    for d, rows in t["rounds"].items():
        assert [r["round"] for r in rows] == [1, 2]
        for r in rows:  # every round: accuracy, bytes, and each attack's leakage on the updates the server received
            assert 0.0 <= r["test_accuracy"] <= 1.0 and r["bytes_up"] > 0 and r["bytes_down"] > 0
            assert set(r["leakage"]) == {"ig(iterations=3)", "labels"} and "psnr" in r["leakage"]["ig(iterations=3)"]
            assert r["worst_case"]["attack"] == "ig(iterations=3)"  # the image rebuild outranks labels only
        assert set(t["clients"][d]) == {"0", "1"} and t["bytes"][d]["bytes_total"] > 0
        wc = t["worst_case"][d]
        assert wc["attack"] == "ig(iterations=3)" and wc["value"] == t["leakage"][d]["ig(iterations=3)"]["psnr"]
        best = max(r["leakage"]["ig(iterations=3)"]["psnr"] for r in rows)  # the verdict is the worst round
        assert t["leakage"][d]["ig(iterations=3)"]["psnr"] == best
        # the budget: IG runs its 3 iterations on every audited update (all rounds), labels is closed-form
        assert t["budget"][d] == {
            "ig(iterations=3)": {"budget_used": 1.0, "budget_used_max": 1.0, "budget_stopped": 1.0}
        }
    assert s["over_budget"] == []  # the protocols' cells are checked too, not only the single-step ones
    # FedSGD at batch 1: the server's update is one raw gradient, and APRIL rebuilds the image exactly
    sgd = s["tasks"]["sgd"]
    assert sgd["worst_case"]["none"]["attack"] == "april" and sgd["worst_case"]["none"]["value"] > 30
    report = (tmp_path / "out" / "report.md").read_text()
    assert "Federated training, audited round by round" in report and "figures/avg_rounds.png" in report
    assert (tmp_path / "out" / "figures" / "avg_rounds.png").stat().st_size > 1000


def test_killed_fedavg_audit_resumes_with_identical_numbers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from veil.federated.fedavg import server_app

    torch.set_num_threads(1)
    raw = copy.deepcopy(FEDAVG)
    raw["tasks"] = raw["tasks"][:1]
    full = run_audit(parse_scenario(copy.deepcopy(raw)), tmp_path / "full", progress=False)
    original = server_app.ServerState.save
    calls = {"n": 0}

    def killed_in_second_run(self: server_app.ServerState) -> None:
        original(self)
        calls["n"] += 1
        if calls["n"] == 3:  # defense none finished (2 rounds), the gaussian run killed after its round 1
            raise KeyboardInterrupt("audit killed")

    monkeypatch.setattr(server_app.ServerState, "save", killed_in_second_run)
    with pytest.raises(KeyboardInterrupt):
        run_audit(parse_scenario(copy.deepcopy(raw)), tmp_path / "cut", progress=False)
    monkeypatch.setattr(server_app.ServerState, "save", original)
    finished = (tmp_path / "cut" / "runs" / "avg" / "none" / "seed0" / "metrics.jsonl").read_text()
    resumed = run_audit(parse_scenario(copy.deepcopy(raw)), tmp_path / "cut", progress=False)
    assert (
        tmp_path / "cut" / "runs" / "avg" / "none" / "seed0" / "metrics.jsonl"
    ).read_text() == finished  # reused, not rerun
    assert untimed(resumed["tasks"]) == untimed(full["tasks"])


def test_split_audit_reports_protocols_bytes_and_feature_attacks(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    s = run_audit(parse_scenario(copy.deepcopy(SPLIT)), tmp_path / "out", progress=False)
    t = s["tasks"]["sp"]
    assert set(t) <= task_keys()
    adaptive, naive = "feature_inversion(steps=20)", "feature_inversion(steps=20,unshuffle=False)"
    assert set(t["split"]) == {"sl", "pfesta", "fl"}
    assert (
        t["split"]["pfesta"]["bytes_per_client"] < t["split"]["sl"]["bytes_per_client"]
    )  # features sent once, not every step
    assert set(t["leakage"]) == {"sl", "pfesta"} and t["worst_case"]["fl"]["attack"] is None  # FL sends no features
    # un-shuffling through the head undoes p-FeSTA's permutation exactly: the same PSNR as on SL's plain features
    assert t["leakage"]["pfesta"][adaptive]["psnr"] == pytest.approx(t["leakage"]["sl"][adaptive]["psnr"], abs=1e-4)
    assert t["leakage"]["pfesta"][naive]["psnr"] < t["leakage"]["pfesta"][adaptive]["psnr"]
    assert t["worst_case"]["pfesta"]["attack"] == adaptive
    for d in ("sl", "pfesta"):  # each feature attack trains its decoder for exactly its 20 steps
        assert {a: acc["budget_used"] for a, acc in t["budget"][d].items()} == {adaptive: 1.0, naive: 1.0}
    assert "fl" not in t["budget"] and s["over_budget"] == []
    assert "Split learning: protocols, bytes and feature-space attacks" in (tmp_path / "out" / "report.md").read_text()


def test_unknown_protocol_is_a_one_line_error() -> None:
    raw = copy.deepcopy(FEDAVG)
    raw["tasks"][0]["protocol"] = "gossip"
    with pytest.raises(
        VeilError, match="unknown protocol 'gossip' in tasks\\[0\\]; allowed: single-step, dp-audit, fedavg, split"
    ) as e:
        parse_scenario(raw)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda t: t["federated"].update(audit=["ig"]), "federated.audit is set from the task's attacks"),
        (lambda t: t["federated"].update(clients=0), "federated.clients and federated.rounds must be at least 1"),
        (lambda t: t["federated"].update(colour=1), "unknown config key 'federated.colour'"),
        (lambda t: t.update(knowledge={"labels": True}), "knowledge.labels cannot be granted"),
        (lambda t: t.update(attacks=["feature_inversion"]), "does not apply to task 'avg'"),
    ],
)
def test_bad_fedavg_task_is_refused_before_training(change: Any, message: str) -> None:
    raw = copy.deepcopy(FEDAVG)
    change(raw["tasks"][0])
    with pytest.raises(VeilError, match=message):
        validate(parse_scenario(raw))


def test_bad_split_task_is_refused_before_training() -> None:
    raw = copy.deepcopy(SPLIT)
    raw["tasks"][0]["defenses"] = ["sl", "gossip"]
    with pytest.raises(VeilError, match="unknown split protocol 'gossip'"):
        validate(parse_scenario(raw))
    raw = copy.deepcopy(SPLIT)
    raw["tasks"][0]["attacks"] = ["april"]
    with pytest.raises(VeilError, match="sees head features, not gradients"):
        validate(parse_scenario(raw))


def test_split_run_config_is_audited_as_its_protocol_table() -> None:
    from veil.experiments.scenario import load_scenario

    s = load_scenario(Path(__file__).parent.parent / "configs" / "paper" / "pfesta_tables4_5.yaml")
    (task,) = s.tasks
    assert task.protocol == "split" and [d["name"] for d in task.defenses] == ["central", "fl", "sl", "festa", "pfesta"]
    assert {a["name"] for a in task.attacks} == {"feature_inversion", "fsha"} and "protocol" not in task.federated


MULTI = {
    "name": "multi",
    "seeds": [0],
    "tasks": [
        {
            "name": "rounds",
            "protocol": "fedavg",
            "run": TINY_RUN,
            "defenses": [{"name": "gaussian", "sigma": 0.1}],
            "attacks": [
                {"name": "ig-fedavg", "iterations": 2},
                {"name": "multi-round", "iterations": 3},
                {"name": "multi-round-global", "iterations": 3},
            ],
            "federated": {"clients": 2, "rounds": 3, "local_steps": 2, "audit_clients": 1},
        }
    ],
}


def test_server_knowledge_rebuilds_the_clients_real_round(tmp_path: Path) -> None:
    """What the auditor hands ig-fedavg (Observation.local: AdamW groups, clip, lr, steps, the seeded
    batch schedule, the partition size) reproduces a client's real FedAvg update from its true images."""
    from veil.attacks.inverting_fedavg import LocalSimulator
    from veil.federated.fedavg.audit import task_spec
    from veil.federated.fedavg.server_app import ServerState, make_auditor
    from veil.federated.fedavg.task import (
        client_split,
        client_world,
        local_slots,
        model_arrays,
        reset_defenses,
        train_round,
    )

    torch.set_num_threads(1)
    task = parse_scenario(copy.deepcopy(MULTI)).tasks[0]
    spec = task_spec(task, {"name": "none"}, 0, [{"name": "ig-fedavg"}])
    spec.cfg.train.weight_decay, spec.cfg.train.clip = 0.05, 1.0
    spec = type(spec)(
        spec.cfg, spec.fed, {**spec.raw, "train": {**spec.raw["train"], "weight_decay": 0.05, "clip": 1.0}}
    )
    world = client_world(spec.text())
    reset_defenses(world)
    state = ServerState(spec, tmp_path)
    sizes = {pid: len(part) for pid, part in enumerate(world.parts)}
    auditor = make_auditor(spec, state, oracle=False, sizes=sizes)
    w0 = model_arrays(state.model)
    world.model.load_state_dict(w0.to_torch_state_dict())
    res = train_round(world, pid=1, rnd=2, lr=0.002, mu=0.0)
    local = auditor.local_training(2, 1, 0.002, res.steps)
    assert local is not None and local.steps == 2 and local.clip == 1.0 and local.order is not None
    split = client_split(world, 1)
    used = sorted({int(i) for idx in local_slots(sizes[1], spec.cfg.train.batch_size, 0, 2, 1, 1, 2) for i in idx})
    auditor.model.load_state_dict(w0.to_torch_state_dict())
    auditor.model.eval()
    names = [n for n, p in auditor.model.named_parameters() if p.requires_grad]
    sim = LocalSimulator(auditor.model, names, local)
    got = dict(zip(names, sim.unflat(sim.delta(split["pixels"][used], split["labels"][used]).detach())))
    real = {n: w0.to_torch_state_dict()[n] - p.detach() for n, p in world.model.named_parameters()}
    for n in names:
        if not n.endswith("attn.k.bias"):  # rounding noise only (softmax is shift invariant)
            assert torch.allclose(got[n], real[n], rtol=1e-3, atol=1e-7), n
    # a wrong schedule (consecutive batches instead of the seeded one) does not reproduce it
    wrong = LocalSimulator(auditor.model, names, type(local)(**{**local.__dict__, "order": None}))
    off = wrong.delta(split["pixels"][used], split["labels"][used]).detach()
    assert not torch.allclose(off, torch.cat([real[n].flatten() for n in names]), rtol=1e-3, atol=1e-7)


def test_multi_round_attackers_and_their_resume(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from helpers import kill_server_after_round

    torch.set_num_threads(1)
    full = run_audit(parse_scenario(copy.deepcopy(MULTI)), tmp_path / "full", progress=False)
    t = full["tasks"]["rounds"]
    mean, glob, ig = "multi-round(iterations=3)", "multi-round-global(iterations=3)", "ig-fedavg(iterations=2)"
    rows = t["rounds"]["gaussian(sigma=0.1)"]
    assert [sorted(r["leakage"]) for r in rows] == [sorted([mean, ig])] + [
        sorted([mean, glob, ig])
    ] * 2  # no previous global model at round 1
    assert [r["leakage"][mean]["rounds_averaged"] for r in rows] == [1.0, 2.0, 3.0]  # the client's running mean
    assert [r["leakage"][glob]["of_round"] for r in rows[1:]] == [1.0, 2.0]
    assert set(t["clients"]["gaussian(sigma=0.1)"]) == {"0"}  # the aggregate's rebuild is scored per audited client
    assert all("psnr" in r["leakage"][ig] and "psnr" in r["leakage"][glob if r["round"] > 1 else mean] for r in rows)
    assert "every round's update of the client, averaged" in t["attacker_knows"][mean]
    undo = kill_server_after_round(monkeypatch, 2)
    with pytest.raises(KeyboardInterrupt):
        run_audit(parse_scenario(copy.deepcopy(MULTI)), tmp_path / "cut", progress=False)
    undo()
    ck = tmp_path / "cut" / "runs" / "rounds" / "gaussian(sigma=0.1)" / "seed0" / "checkpoints"
    assert (ck / "auditor.safetensors").is_file()  # the running sums and the last global model, beside the model
    resumed = run_audit(parse_scenario(copy.deepcopy(MULTI)), tmp_path / "cut", progress=False)
    assert untimed(resumed["tasks"]) == untimed(full["tasks"])


def test_rounds_attacks_are_refused_outside_fedavg() -> None:
    raw = {"name": "s", "seeds": [0], "tasks": [{"name": "one", "run": TINY_RUN, "attacks": ["ig-fedavg"]}]}
    with pytest.raises(VeilError, match="use it in a task with protocol: fedavg"):
        validate(parse_scenario(raw))
    raw = copy.deepcopy(MULTI)
    raw["tasks"][0]["attacks"] = [{"name": "multi-round", "attack": "april"}]
    with pytest.raises(
        VeilError, match="multi-round: option 'attack' must be one of 'ig', 'dlg', 'labels', got 'april'"
    ):
        validate(parse_scenario(raw))
    for entry, message in (
        # the inner attack's options are multi-round's too: the list names ig's beside its own
        (
            {"name": "multi-round", "iterashuns": 3},
            r"multi-round: unknown option 'iterashuns' .*options: attack, .*restarts",
        ),
        (
            {"name": "ig-fedavg", "iterashuns": 3},
            "ig-fedavg: unknown option 'iterashuns' \\(did you mean 'iterations'\\?\\)",
        ),
    ):
        raw["tasks"][0]["attacks"] = [entry]
        with pytest.raises(VeilError, match=message) as e:
            validate(parse_scenario(raw))
        assert "\n" not in str(e.value)


def test_averaging_over_rounds_removes_fresh_noise(tmp_path: Path) -> None:
    """FedSGD, the client's whole partition in every round's batch, Gaussian noise on every gradient
    entry: one round's bias gradient is mostly noise, its mean over rounds is not, so label recovery
    on the multi-round mean beats label recovery on each round's own update. Measured (sigma 0.3, 10
    rounds): per-round 0.18-0.65 (last 0.43, mean of rounds 6-10 0.52); on the running mean rising
    to 0.77 (rounds 6-10: 0.73)."""
    torch.set_num_threads(1)
    raw = {
        "name": "avg",
        "seeds": [0],
        "tasks": [
            {
                "name": "noisy",
                "protocol": "fedavg",
                "run": {
                    **TINY_RUN,
                    "data": {"name": "digits", "train_size": 120, "test_size": 100},
                    "train": {"batch_size": 64, "lr": 0.001, "seed": 0, "clip": 0.0},
                },
                "defenses": [{"name": "gaussian", "sigma": SIGMA}],
                "attacks": ["labels", {"name": "multi-round", "attack": "labels"}],
                "federated": {"clients": 2, "rounds": ROUNDS, "mode": "fedsgd", "partition": "iid", "audit_clients": 1},
            }
        ],
    }
    s = run_audit(parse_scenario(raw), tmp_path / "out", progress=False)
    rows = s["tasks"]["noisy"]["rounds"][f"gaussian(sigma={SIGMA})"]
    single = [r["leakage"]["labels"]["label_accuracy"] for r in rows]
    mean = [r["leakage"]["multi-round(attack=labels)"]["label_accuracy"] for r in rows]
    assert mean[0] == single[0]  # one round: the mean is the update
    assert mean[-1] > single[-1] + 0.2 and sum(mean[5:]) / 5 > sum(single[5:]) / 5 + 0.15
    assert mean[-1] > mean[0] + 0.4  # the more rounds averaged, the less noise
