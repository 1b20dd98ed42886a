"""Exact resume for every registered defense: a run killed at a random step and resumed in a fresh
process state ends with the weights of the run that was never interrupted, bit for bit.

What has to survive the kill is every random stream a run draws from: the data order and dropout
(reseeded per epoch by the loop), MJP's pooled masks and its own generator, the noise counters of
AEGIS and the Gaussian baseline, DP-SGD's noise seed (drawn from the OS when none is configured).
"""

from __future__ import annotations

import json
import math
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import veil.training.loop as loop
from veil.config import RunConfig, dump_config, load_config
from veil.defenses import list_defenses
from veil.training.loop import train

IMAGE = [
    "model=vit-digits",
    "model.depth=1",
    "model.dim=32",
    "model.heads=2",
    "data=digits",
    "data.train_size=96",
    "data.test_size=32",
]
TEXT = [
    "model=transformer4",
    "model.depth=1",
    "model.dim=32",
    "model.heads=2",
    "data=sst2",
    "data.train_size=96",
    "data.test_size=32",
    "data.max_len=16",
]
RUN = ["train.epochs=3", "train.batch_size=16", "train.lr=0.003", "train.eval_batch_size=64"]
#: each registered defense with settings that make every one of its random streams matter
CASES: dict[str, list[str]] = {
    "none": IMAGE,
    "mjp": [*IMAGE, "defense=mjp", "defense.gamma=0.3"],
    "mjp-seeded-text": [*TEXT, "defense=mjp", "defense.gamma=0.5", "defense.seed=7", "defense.aux=drl"],
    "aegis": [*TEXT, "defense=aegis"],
    "dpsgd": [*IMAGE, "defense=dpsgd", "defense.noise_multiplier=1.0", "defense.clip=1.0", "defense.seed=5"],
    "gaussian": [*IMAGE, "defense=gaussian", "defense.sigma=0.05"],
    "prune": [*IMAGE, "defense=prune"],
    # LoRA (train.lora): the adapters-only checkpoint resumes exactly, on an LM and under AEGIS's noise
    "none-lora": [*TEXT, "model=llama-tiny", "model.mlp_hidden=64", "train.lora.r=4"],
    "aegis-lora": [*TEXT, "defense=aegis", "train.lora.r=4"],
}
#: split learning's client-side permutation is refused outside split learning (tests/test_split.py)
NOT_TRAINED_ALONE = {"permutation"}


def test_every_registered_defense_has_a_resume_case() -> None:
    covered = {c.split("-")[0] for c in CASES}
    assert set(list_defenses()) - NOT_TRAINED_ALONE <= covered


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "checkpoints" / "model.safetensors"))


def _killed_at(step: int):
    real = loop.client_step

    def dying(*args, **kwargs):
        if kwargs["step"] == step:
            raise KeyboardInterrupt  # the process dies mid-epoch, after the last checkpoint
        return real(*args, **kwargs)

    return dying


def _kill_and_resume(cfg: RunConfig, out: Path, steps: int, seed: str, monkeypatch: pytest.MonkeyPatch) -> dict:
    step = random.Random(seed).randrange(steps // 3 + 1, steps - 1)  # past the first checkpoint, not on one
    with monkeypatch.context() as m:
        m.setattr(loop, "client_step", _killed_at(step))
        with pytest.raises(KeyboardInterrupt):
            train(cfg, out, progress=False)
    assert (out / "checkpoints" / "state.json").is_file()
    assert not (out / "summary.json").exists()
    return train(cfg, out, progress=False)  # a fresh model, data and defense objects


@pytest.mark.parametrize("case", sorted(CASES))
def test_killed_at_a_random_step_and_resumed_is_bit_identical(
    case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = load_config(None, CASES[case] + RUN)
    full = train(cfg, tmp_path / "full", progress=False)
    resumed = _kill_and_resume(cfg, tmp_path / "cut", full["steps"], case, monkeypatch)
    a, b = _weights(tmp_path / "full"), _weights(tmp_path / "cut")
    assert a.keys() == b.keys()
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"{case}: weights differ after resume in {differ[:4]}"
    assert resumed["test_accuracy"] == full["test_accuracy"]
    assert (tmp_path / "cut" / "metrics.jsonl").read_text() == (tmp_path / "full" / "metrics.jsonl").read_text()


def test_dpsgd_default_noise_seed_survives_the_kill(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With no seed configured, DP-SGD draws its noise seed from the OS: nobody holding the config can
    replay the noise, and a resumed run continues the first process's stream (kept in the run's own
    checkpoint), so it ends where an uninterrupted run with that seed ends."""
    dp = [*IMAGE, "defense=dpsgd", "defense.noise_multiplier=1.0", "defense.clip=1.0"]
    cfg = load_config(None, dp + RUN)
    steps = 3 * math.ceil(96 / 16)
    _kill_and_resume(cfg, tmp_path / "cut", steps, "dpsgd-os", monkeypatch)
    seed = int(load_file(str(tmp_path / "cut" / "checkpoints" / "streams.safetensors"))["0.dpsgd.seed"])
    train(load_config(None, [*dp, f"defense.seed={seed}", *RUN]), tmp_path / "full", progress=False)
    a, b = _weights(tmp_path / "full"), _weights(tmp_path / "cut")
    assert all(torch.equal(a[k], b[k]) for k in a)
    other = train(cfg, tmp_path / "other", progress=False)  # another process: another seed, other weights
    assert other["steps"] == steps
    assert not all(torch.equal(a[k], v) for k, v in _weights(tmp_path / "other").items())


def test_veil_train_killed_by_a_signal_mid_epoch_resumes_bit_identical(tmp_path: Path) -> None:
    """The issue's case, in real processes: `veil train` with MJP on digits, SIGKILLed at whatever
    step it has reached once its first checkpoint is on disk, then run again."""
    path = tmp_path / "mjp.yaml"
    path.write_text(dump_config(load_config(None, [*CASES["mjp"], *RUN, "train.epochs=4", "train.threads=1"])))
    args = [str(path), "--quiet"]
    cli = [sys.executable, "-m", "veil.cli", "train"]
    done = subprocess.run([*cli, *args, "--out", str(tmp_path / "full")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    proc = subprocess.Popen([*cli, *args, "--out", str(tmp_path / "cut")], stderr=subprocess.PIPE, text=True)
    state = tmp_path / "cut" / "checkpoints" / "state.json"
    deadline = time.monotonic() + 300  # a safety net for a run that never checkpoints, not the check
    while not state.is_file() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert not (tmp_path / "cut" / "summary.json").exists(), "the run ended before the kill: nothing was tested"
    again = subprocess.run([*cli, *args, "--out", str(tmp_path / "cut")], capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    a, b = _weights(tmp_path / "full"), _weights(tmp_path / "cut")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert (
        json.loads((tmp_path / "cut" / "summary.json").read_text())["test_accuracy"]
        == json.loads((tmp_path / "full" / "summary.json").read_text())["test_accuracy"]
    )


AUDIT = {
    "name": "resume",
    "seeds": [0],
    "attacks": ["labels"],
    "tasks": [
        {
            "name": "digits",
            "run": {
                "model": {"name": "vit-digits", "depth": 1, "dim": 32, "heads": 2},
                "data": {"name": "digits", "train_size": 96, "test_size": 32},
                "train": {"epochs": 3, "batch_size": 16, "lr": 0.003},
            },
            "defenses": [
                "none",
                {"name": "mjp", "gamma": 0.3},
                {"name": "dpsgd", "noise_multiplier": 1.0, "clip": 1.0, "seed": 5},
                {"name": "gaussian", "sigma": 0.05},
                "prune",
            ],
            "attacks": ["april"],
            "knowledge": {"batch_size": 1},
            "samples": 1,
        },
        {
            "name": "text",
            "run": {
                "model": {"name": "transformer4", "depth": 1, "dim": 32, "heads": 2},
                "data": {"name": "sst2", "tokenizer": "word", "max_len": 12, "train_size": 96, "test_size": 16},
                "train": {"epochs": 3, "batch_size": 16},
            },
            "defenses": ["aegis"],
            "attacks": ["presence"],
            "knowledge": {"labels": True, "batch_size": 1},
            "samples": 1,
        },
    ],
}


#: the audit trains its runs one after another, 18 steps each: none, mjp, dpsgd, gaussian, prune
#: (digits), then aegis (text); each kill lands mid-epoch (step 13 of 18) in one defended run
AUDIT_KILLS = {
    "mjp": 18 + 13,
    "dpsgd": 2 * 18 + 13,
    "gaussian": 3 * 18 + 13,
    "prune": 4 * 18 + 13,
    "aegis": 5 * 18 + 13,
}


@pytest.fixture(scope="module")
def full_audit(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """The uninterrupted audit every killed one is compared with (run once)."""
    from veil.experiments.audit import run_audit
    from veil.experiments.scenario import parse_scenario

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("audit") / "full"
    return path, run_audit(parse_scenario(AUDIT), path, progress=False)


def test_every_registered_defense_is_killed_in_the_audit_resume_case() -> None:
    assert set(list_defenses()) - NOT_TRAINED_ALONE <= set(AUDIT_KILLS) | {"none"}


@pytest.mark.parametrize("defense", sorted(AUDIT_KILLS))
def test_audit_killed_mid_training_resumes_to_the_same_summary(
    defense: str, full_audit: tuple[Path, dict], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from veil.experiments.audit import run_audit
    from veil.experiments.scenario import parse_scenario

    kill_at = AUDIT_KILLS[defense]
    full_dir, full = full_audit
    calls = {"n": 0}
    real = loop.client_step

    def dying(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == kill_at:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(loop, "client_step", dying)
        with pytest.raises(KeyboardInterrupt):
            run_audit(parse_scenario(AUDIT), tmp_path / "cut", progress=False)
    unfinished = [
        p.parent.name for p in (tmp_path / "cut" / "runs").glob("*/*/seed0") if not (p / "summary.json").is_file()
    ]
    assert [u.split("(")[0] for u in unfinished] == [defense]  # the kill fell in this defense's run
    resumed = run_audit(parse_scenario(AUDIT), tmp_path / "cut", progress=False)
    for run in (full_dir / "runs").rglob("model.safetensors"):
        twin = tmp_path / "cut" / run.relative_to(full_dir)
        a, b = load_file(str(run)), load_file(str(twin))
        assert all(torch.equal(a[k], b[k]) for k in a), f"weights differ after resume: {twin}"

    def numbers(s: dict) -> dict:  # every leakage and utility number but wall-clock timings
        return {
            t: (task["utility"], task["leakage"]) for t, task in json.loads(json.dumps(s, default=str))["tasks"].items()
        }

    assert _drop_timing(numbers(resumed)) == _drop_timing(numbers(full))


def _drop_timing(x):
    if isinstance(x, dict):
        return {k: _drop_timing(v) for k, v in x.items() if "second" not in k and k not in ("train_seconds",)}
    if isinstance(x, (list, tuple)):
        return [_drop_timing(v) for v in x]
    return x


@pytest.mark.parametrize("defense", ["mjp", "gaussian", "dpsgd"])
def test_an_attack_cell_does_not_depend_on_the_cells_before_it(defense: str, tmp_path: Path) -> None:
    """The audit attacks one loaded run cell after cell; each cell starts from the defenses' streams
    as loaded, so a resumed audit (some cells cached) or a parallel one gives the same numbers."""
    from veil.attacks import create_attack
    from veil.build import load_run
    from veil.experiments.cells import run_cell

    settings = {"mjp": ["defense.gamma=0.3"], "gaussian": ["defense.sigma=0.05"], "dpsgd": ["defense.seed=3"]}
    dp = ["defense.noise_multiplier=1.0", "defense.clip=1.0"] if defense == "dpsgd" else []
    cfg = load_config(None, [*IMAGE, f"defense={defense}", *settings[defense], *dp, *RUN, "train.epochs=1"])
    train(cfg, tmp_path / "r", progress=False)
    _, model, data, defenses = load_run(tmp_path / "r")
    attack = create_attack("april")
    first = run_cell(attack, model, data, defenses, {"batch_size": 1}, 2, 0)["metrics"]
    run_cell(create_attack("labels"), model, data, defenses, {"batch_size": 1}, 3, 1)  # another cell between
    again = run_cell(attack, model, data, defenses, {"batch_size": 1}, 2, 0)["metrics"]
    first.pop("seconds"), again.pop("seconds")
    assert first == again
