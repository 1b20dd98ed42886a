"""The audit's shared frozen-encoder features (`veil.experiments.features`): the runs of a scenario
with `train.frozen_features` on one encoder and one data set compute the encoder's output once, and
each trains the same DP head as `veil train` of its config; a cell keeps a matching attack's cosine;
tasks sharing a data set load it once while the scenario is validated."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from veil.config import from_dict
from veil.errors import VeilError
from veil.experiments import audit as engine
from veil.experiments.audit import run_audit, run_dir
from veil.experiments.scenario import parse_scenario
from veil.training.loop import train

RUN = {
    "model": {"name": "hf-bert", "dim": 32, "depth": 2, "heads": 2, "dropout": 0.0},
    "data": {"name": "sst2", "max_len": 16, "train_size": 96, "test_size": 32},
    "train": {"epochs": 2, "batch_size": 32, "lr": 0.05, "threads": 1, "frozen_features": True},
}
DP = {"name": "dpsgd", "noise_multiplier": 1.0, "clip": 0.5, "trainable": "classifier", "seed": 3, "chunk": 16}


def _scenario() -> dict:
    slow = {**RUN, "train": {**RUN["train"], "lr": 0.01}}
    return {
        "name": "frozen",
        "seeds": [0, 1],
        "tasks": [
            {"name": "fast", "run": RUN, "defenses": [DP, {**DP, "noise_multiplier": 0.0}]},
            {"name": "slow", "run": slow, "defenses": [DP]},
        ],
    }


def test_runs_share_one_feature_pass_and_train_as_veil_train(tmp_path: Path) -> None:
    s = parse_scenario(_scenario())
    summary = run_audit(s, tmp_path / "audit", progress=False)
    # 6 runs, one encoder pass per seed: hf-bert from a config is initialised by the run's seed
    assert len(list((tmp_path / "audit" / "features").glob("*.safetensors"))) == 2
    task = s.tasks[0]
    for seed in (0, 1):  # each run is what `veil train` of its config gives (which computes the features itself)
        alone = train(task.run_for(DP, seed), tmp_path / f"alone{seed}", progress=False)
        got = json.loads((run_dir(tmp_path / "audit", task, DP, seed) / "summary.json").read_text())
        assert got["test_accuracy"] == alone["test_accuracy"]
        assert got["privacy"]["epsilon"] == alone["privacy"]["epsilon"] and got["steps"] == alone["steps"]
        w = load_file(str(run_dir(tmp_path / "audit", task, DP, seed) / "checkpoints" / "model.safetensors"))
        ref = load_file(str(tmp_path / f"alone{seed}" / "checkpoints" / "model.safetensors"))
        assert all(torch.allclose(w[k], ref[k], atol=1e-5) for k in ref)
    u = summary["tasks"]["fast"]["utility"]
    assert len(u) == 2 and all(len(v["test_accuracy_values"]) == 2 for v in u.values())
    assert summary["tasks"]["slow"]["utility"]


def test_parallel_workers_read_the_features_the_parent_computed(tmp_path: Path) -> None:
    defenses = [DP, {**DP, "noise_multiplier": 0.5}]
    s = parse_scenario({"name": "x", "tasks": [{"name": "t", "run": RUN, "defenses": defenses}]})
    summary = run_audit(s, tmp_path, progress=False, jobs=2)
    assert len(list((tmp_path / "features").glob("*.safetensors"))) == 1
    alone = train(s.tasks[0].run_for(defenses[1], 0), tmp_path / "alone", progress=False)
    assert summary["tasks"]["t"]["utility"][
        "dpsgd(chunk=16,clip=0.5,noise_multiplier=0.5,seed=3,trainable=classifier)"
    ]["test_accuracy_values"] == [alone["test_accuracy"]]


def test_a_run_that_cannot_use_cached_features_is_one_line(tmp_path: Path) -> None:
    s = parse_scenario(
        {"tasks": [{"name": "t", "run": RUN, "defenses": [{**DP, "trainable": "layer\\.1\\.|classifier"}]}]}
    )
    with pytest.raises(VeilError, match="^train.frozen_features: parameters outside the classifier train"):
        run_audit(s, tmp_path, progress=False)


def test_tasks_sharing_a_data_set_load_it_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = engine.build_data
    monkeypatch.setattr(engine, "build_data", lambda cfg: calls.append(cfg.data) or real(cfg))
    engine.validate(parse_scenario(_scenario()))
    assert len(calls) == 1


def test_a_head_embedding_cell_keeps_the_match_cosine(tmp_path: Path) -> None:
    """The cell keeps the attack's best cosine (`match_cosine`): 1 on an undefended head-only update."""
    run = {**RUN, "train": {"threads": 1}}
    task = {
        "name": "t",
        "run": run,
        "weights": "init",
        "defenses": [{**DP, "noise_multiplier": 0.0}],
        "attacks": ["head-embedding"],
        "knowledge": {"batch_size": 1},
        "samples": 2,
    }
    s = run_audit(parse_scenario({"name": "x", "tasks": [task]}), tmp_path, progress=False)
    m = next(iter(s["tasks"]["t"]["leakage"].values()))["head-embedding"]
    assert m["match_cosine"] == pytest.approx(1.0, abs=1e-6) and m["exact_recovery"] == 1.0


def test_features_follow_the_config_not_the_seed_of_a_pretrained_head(tmp_path: Path) -> None:
    """The key covers the data: another training subset is another cache file."""
    cfg = from_dict({**RUN, "defense": [DP]})
    other = from_dict({**RUN, "data": {**RUN["data"], "train_size": 64}, "defense": [DP]})
    from veil.experiments.features import frozen_run

    frozen_run(cfg, tmp_path)
    _, data, _ = frozen_run(other, tmp_path)
    assert len(list(tmp_path.glob("*.safetensors"))) == 2 and len(data.train["labels"]) == 64


def test_a_dp_schedule_the_data_cannot_hold_fails_before_training(tmp_path: Path) -> None:
    big = {**RUN, "train": {**RUN["train"], "batch_size": 512}}
    with pytest.raises(VeilError, match=r"^task 't', defense dpsgd\(.*\): dpsgd needs 1 <= train.batch_size"):
        engine.validate(parse_scenario({"tasks": [{"name": "t", "run": big, "defenses": [DP]}]}))
    assert not (tmp_path / "runs").exists()


def test_the_step_time_of_a_target_epsilon_run_is_measured_at_its_sigma(tmp_path: Path) -> None:
    """The audit's step-time measurement prepares DP-SGD for the run's schedule (sigma from the accountant)."""
    eps = {k: v for k, v in DP.items() if k != "noise_multiplier"} | {"target_epsilon": 8.0}
    s = run_audit(parse_scenario({"tasks": [{"name": "t", "run": RUN, "defenses": [DP, eps]}]}), tmp_path, False)
    label = "dpsgd(chunk=16,clip=0.5,seed=3,target_epsilon=8.0,trainable=classifier)"
    assert label in s["tasks"]["t"]["overhead"] and s["tasks"]["t"]["utility"][label]["privacy"]["epsilon"] <= 8.0
    t = s["tasks"]["t"]
    # no `none` run in this task: its step is measured beside them all the same, and is the reference
    assert "none" in t["step_seconds"] and "none" not in t["overhead"]
    assert t["overhead"][label] == pytest.approx(t["step_seconds"][label] / t["step_seconds"]["none"])
