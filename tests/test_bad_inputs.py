"""Every bad input of issue 23, through the real `veil` entry point: exit code 2, exactly one line
on stderr naming the problem, no traceback, and it fails before any training starts."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from veil.cli import main

ROOT = Path(__file__).resolve().parent.parent
VIT = str(ROOT / "configs" / "vit_digits.yaml")
LFW = str(ROOT / "configs" / "mjp_vit_lfw.yaml")  # vit-digits on 32x32 LFW faces
TEXT = ["data=sst2", "data.tokenizer=wordpiece", "data.max_len=16", "data.train_size=40", "data.test_size=20"]
SMALL = ["data.train_size=40", "data.test_size=20"]

CASES = {
    "batch size 0": ([VIT, "train.batch_size=0"], "'train.batch_size' must be an integer >= 1, got 0"),
    "negative lr": ([VIT, "train.lr=-0.01"], "'train.lr' must be a number > 0, got -0.01"),
    "zero epochs": ([VIT, "train.epochs=0"], "'train.epochs' must be an integer >= 1, got 0"),
    "negative epochs": ([VIT, "train.epochs=-2"], "'train.epochs' must be an integer >= 1, got -2"),
    "word for a width": ([VIT, "model.dim=big"], "config key 'model.dim' must be int, got 'big'"),
    "quoted fraction": ([VIT, 'data.test_fraction="0.2"'], "config key 'data.test_fraction' must be float, got '0.2'"),
    "hf-gpt2 dim % heads": (
        [VIT, "model=hf-gpt2", *TEXT, "model.dim=100", "model.heads=3"],
        "model 'hf-gpt2': dim 100 is not divisible by heads 3",
    ),
    "gpt-tiny dim % heads": (
        [VIT, "model=gpt-tiny", *TEXT, "model.dim=100", "model.heads=3"],
        "model 'gpt-tiny': dim 100 is not divisible by heads 3",
    ),
    "patch 5 on 32 px": ([LFW, "model.patch_size=5", *SMALL], "patch_size 5 does not divide the 32x32 image"),
    "warmup 3.0": ([VIT, "warmup=3.0"], "'train.warmup' must be a fraction of all steps in [0, 1], got 3.0"),
    "clip -1": ([VIT, "clip=-1"], "'train.clip' must be a max gradient norm >= 0"),
    "hf-bert depth 0": (
        [VIT, "model=hf-bert", *TEXT, "model.depth=0"],
        "model 'hf-bert': depth must be an integer >= 1, got 0",
    ),
    "hf-vit dim % heads": (
        [VIT, "model=hf-vit", *SMALL, "model.dim=50", "model.heads=4"],
        "model 'hf-vit': dim 50 is not divisible by heads 4",
    ),
    "bare gamma": ([VIT, "gamma=1.5"], "defense=mjp defense.gamma=VALUE"),
}


def run_cli(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, list[str]]:
    code = main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err.strip().splitlines()


def assert_one_line(code: int, lines: list[str], message: str) -> None:
    assert code == 2, lines
    assert len(lines) == 1 and lines[0].startswith("veil: error: "), lines
    assert message in lines[0], lines


@pytest.mark.parametrize("case", list(CASES))
def test_bad_train_input(case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args, message = CASES[case]
    out = tmp_path / "run"
    code, lines = run_cli(capsys, ["train", *args, "--quiet", "--out", str(out)])
    assert_one_line(code, lines, message)
    assert not out.exists()  # failed before anything was written


def test_bare_key_suggests_the_defense_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, lines = run_cli(capsys, ["train", VIT, "gamma=1.5", "--out", str(tmp_path / "r")])
    assert_one_line(code, lines, "unknown config key 'gamma'")
    assert "train.gamma" not in lines[0]


def test_batch_size_zero_inside_a_scenario(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    scenario = {
        "name": "bad",
        "tasks": [
            {
                "name": "digits",
                "defenses": ["none"],
                "attacks": ["april"],
                "run": {"model": "vit-digits", "data": "digits", "train": {"epochs": 1, "batch_size": 0}},
            }
        ],
    }
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(scenario))
    out = tmp_path / "audit"
    code, lines = run_cli(capsys, ["audit", str(path), "--quiet", "--out", str(out)])
    assert_one_line(code, lines, "tasks[0] (digits): config key 'train.batch_size' must be an integer >= 1, got 0")
    assert not out.exists()


def _interrupted_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[Path, list[str]]:
    """A one-step run whose summary is removed: a rerun resumes from its checkpoint."""
    args = ["train", VIT, "model.depth=1", "model.dim=16", "train.max_steps=1", *SMALL, "--quiet"]
    out = tmp_path / "run"
    assert main([*args, "--out", str(out)]) == 0
    capsys.readouterr()
    (out / "summary.json").unlink()
    return out, args


@pytest.mark.parametrize("hash_recorded", [True, False])
def test_truncated_optimizer_state_on_resume(
    hash_recorded: bool, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, args = _interrupted_run(tmp_path, capsys)
    opt = out / "checkpoints" / "optimizer.safetensors"
    opt.write_bytes(opt.read_bytes()[:1000])
    if not hash_recorded:  # a folder from before hashes were recorded: the file itself is checked
        (out / "checkpoints" / "optimizer.safetensors.sha256").unlink()
    code, lines = run_cli(capsys, [*args, "--out", str(out)])
    what = "fails its integrity check" if hash_recorded else "is not a readable safetensors file (truncated or damaged)"
    assert_one_line(code, lines, f"checkpoint '{opt}' {what}")
    assert "to restart the run from its first step" in lines[0]
