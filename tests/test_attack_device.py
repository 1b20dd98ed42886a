"""`attack.device`: where `veil attack` and `veil audit` run the attack phase (auto: CUDA when
present). On a machine without CUDA, auto is the CPU, with the CPU's numbers; a bad value is one
line, before anything loads."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from veil.attacks.harness import attack_device
from veil.build import build_run
from veil.cli import main
from veil.commands.attack import attack_run
from veil.config import from_dict
from veil.errors import VeilError
from veil.experiments.scenario import parse_scenario

CFG = {
    "model": {"name": "vit-digits", "dim": 16, "depth": 1, "heads": 2},
    "data": {"name": "digits", "train_size": 64, "test_size": 32},
    "defense": {"name": "gaussian", "sigma": 0.01},
    "train": {"seed": 0},
}


def _untimed(rows: list[dict[str, float]]) -> list[dict[str, float]]:
    return [{k: v for k, v in r.items() if k not in ("seconds", "iterations_per_second")} for r in rows]


def _run(device: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    model, data, defenses = build_run(from_dict(CFG))
    return attack_run(model, data, defenses, "ig", {"iterations": 4}, samples=2, seed=3, device=device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="auto is the CPU only on a machine without CUDA")
def test_auto_on_a_cpu_machine_is_the_cpu_with_the_same_numbers() -> None:
    assert attack_device("auto") == torch.device("cpu") and attack_device("cpu") == torch.device("cpu")
    cpu, auto = _run("cpu"), _run("auto")
    rows = cpu["runs"]["ig"]["per_sample"]
    assert _untimed(rows) == _untimed(auto["runs"]["ig"]["per_sample"])
    assert cpu["runs"]["ig"]["device"] == auto["runs"]["ig"]["device"] == "cpu"
    assert len(rows) == 2 and rows[0]["psnr"] != rows[1]["psnr"]  # two updates, each its own seed


def test_a_bad_device_is_one_line() -> None:
    with pytest.raises(VeilError, match=r"^attack.device must be one of auto, cpu, cuda, got 'gpu'$"):
        attack_device("gpu")
    if not torch.cuda.is_available():
        with pytest.raises(VeilError, match="no CUDA device is available; use auto or cpu"):
            attack_device("cuda")
    scenario = {"tasks": [{"name": "t", "run": {"model": "vit-digits", "data": "digits"}}]}
    assert parse_scenario(scenario).device == "auto"
    assert parse_scenario({**scenario, "attack": {"device": "cpu"}}).device == "cpu"
    with pytest.raises(VeilError, match=r"attack.device must be one of auto, cpu, cuda, got 'tpu'"):
        parse_scenario({**scenario, "attack": {"device": "tpu"}})
    with pytest.raises(VeilError, match=r"unknown key 'scenario.attack.threads'"):
        parse_scenario({**scenario, "attack": {"threads": 2}})


def test_veil_attack_refuses_a_bad_device_in_one_line(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["attack", "configs/vit_digits.yaml", "--attack", "ig", "attack.device=gpu", "--out", str(tmp_path / "x")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "attack.device must be one of auto, cpu, cuda" in err[0], err
    assert not (tmp_path / "x").exists()
