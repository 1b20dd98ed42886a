"""Weights are named: `veil attack RUN` and `veil eval RUN` read a run's finished model, refuse a
run without one in one line (checkpoints removed, training stopped midway) unless `--checkpoint
last|STEP|init` names the weights, and record the step they read in summary.json."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from veil.cli import main

ROOT = Path(__file__).resolve().parent.parent
TINY = [
    str(ROOT / "configs" / "vit_digits.yaml"),
    "model.depth=1",
    "model.dim=16",
    "data.train_size=64",
    "data.test_size=20",
    "train.batch_size=16",
    "--quiet",
]
ATTACK = ["--attack", "april", "--samples", "1", "--quiet"]


def run_cli(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, list[str]]:
    code = main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err.strip().splitlines()


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("named") / "run"
    assert main(["train", *TINY, "train.max_steps=3", "--out", str(out)]) == 0
    return out


def _stopped_midway(finished: Path, tmp_path: Path) -> Path:
    """A copy of the run as a kill after its first checkpoint leaves it: no summary, no final model."""
    run = tmp_path / "stopped"
    shutil.copytree(finished, run)
    (run / "summary.json").unlink()
    for f in (run / "checkpoints").glob("model.safetensors*"):
        f.unlink()
    state = json.loads((run / "checkpoints" / "state.json").read_text())
    state["loop"]["step"] = 2  # as if stopped at step 2 of 3
    (run / "checkpoints" / "state.json").write_text(json.dumps(state))
    return run


def test_a_finished_run_is_attacked_at_its_final_step(
    finished: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "a"
    code, lines = run_cli(capsys, ["attack", str(finished), *ATTACK, "--out", str(out)])
    assert code == 0, lines
    summary = json.loads((out / "summary.json").read_text())
    assert summary["weights"] == {"source": "run folder", "checkpoint": "final", "step": 3, "finished": True}
    assert summary["runs"]["april"]["weights"]["step"] == 3


def test_a_run_without_checkpoints_is_refused_unless_init_is_named(
    finished: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "gone"
    shutil.copytree(finished, run)
    shutil.rmtree(run / "checkpoints")
    out = tmp_path / "a"
    code, lines = run_cli(capsys, ["attack", str(run), *ATTACK, "--out", str(out)])
    assert code == 2 and len(lines) == 1, lines
    assert "no finished model" in lines[0] and "--checkpoint init" in lines[0], lines
    assert not (out / "summary.json").exists()
    code, lines = run_cli(capsys, ["attack", str(run), *ATTACK, "--checkpoint", "init", "--out", str(out)])
    assert code == 0, lines
    summary = json.loads((out / "summary.json").read_text())
    assert summary["weights"]["checkpoint"] == "init" and summary["weights"]["step"] == 0


def test_a_run_stopped_midway_is_refused_by_attack_and_eval(
    finished: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _stopped_midway(finished, tmp_path)
    code, lines = run_cli(capsys, ["attack", str(run), *ATTACK, "--out", str(tmp_path / "a")])
    assert code == 2 and len(lines) == 1, lines
    assert "training stopped at step 2" in lines[0] and "--checkpoint last" in lines[0], lines
    code, lines = run_cli(capsys, ["eval", str(run), "--out", str(tmp_path / "e")])
    assert code == 2 and len(lines) == 1 and "no finished model" in lines[0], lines


def test_checkpoint_last_and_step_are_recorded(
    finished: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _stopped_midway(finished, tmp_path)
    out = tmp_path / "a"
    code, lines = run_cli(capsys, ["attack", str(run), *ATTACK, "--checkpoint", "last", "--out", str(out)])
    assert code == 0, lines
    weights = json.loads((out / "summary.json").read_text())["weights"]
    assert weights == {"source": "run folder", "checkpoint": "last", "step": 2, "finished": False}
    code, _ = run_cli(capsys, ["eval", str(run), "--checkpoint", "2", "--out", str(tmp_path / "e")])
    assert code == 0
    assert json.loads((tmp_path / "e" / "summary.json").read_text())["weights"]["step"] == 2
    code, lines = run_cli(capsys, ["attack", str(run), *ATTACK, "--checkpoint", "7", "--out", str(out)])
    assert code == 2 and len(lines) == 1 and "no checkpoint at step 7" in lines[0], lines


def test_eval_of_a_missing_folder_names_the_run_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, lines = run_cli(capsys, ["eval", str(tmp_path / "nonexistent")])
    assert code == 2 and len(lines) == 1, lines
    assert "run folder" in lines[0] and "does not exist" in lines[0] and "config file" not in lines[0], lines


def test_attack_on_a_missing_source_says_what_it_takes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, lines = run_cli(capsys, ["attack", str(tmp_path / "nope"), *ATTACK, "--out", str(tmp_path / "a")])
    assert code == 2 and len(lines) == 1, lines
    assert "does not exist" in lines[0] and "run folder" in lines[0] and "YAML config" in lines[0], lines
