"""The `veil` command: help, list, and one line (exit 2, no traceback, nothing written) per bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


def veil(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "veil.cli", *args], capture_output=True, text=True, cwd=cwd, timeout=600
    )


def test_help_and_list() -> None:
    out = veil("--help")
    assert out.returncode == 0 and "train" in out.stdout
    listed = veil("list").stdout
    for name in ("vit-digits", "minilm", "sst2", "digits", "none"):
        assert name in listed


@pytest.mark.parametrize(
    "args, message",
    [
        (["train", "missing.yaml"], "config file 'missing.yaml' does not exist"),
        (["train", "{cfg}", "model=vit-huge"], "unknown model 'vit-huge'"),
        (["train", "{cfg}", "train.epochs=many"], "config key 'train.epochs' must be int"),
        (["train", "{cfg}", "data=table", "data.path={csv}", "data.label_column=lbl"], "label column 'lbl' not found"),
        (["train", "{cfg}", "data=table", "data.path={empty}"], "empty"),
        (["train", "{cfg}", "data=image_folder", "data.path={tmp}/nowhere"], "does not exist"),
    ],
)
def test_bad_input_is_one_line_and_writes_nothing(tmp_path: Path, args: list[str], message: str) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: transformer4\ndata: {name: sst2, tokenizer: word}\ntrain: {epochs: 1}\n")
    csv = tmp_path / "d.csv"
    csv.write_text("text,label\ngood film,pos\nbad film,neg\n")
    empty = tmp_path / "e.csv"
    empty.write_text("text,label\n")
    fill = {"{cfg}": str(cfg), "{csv}": str(csv), "{empty}": str(empty), "{tmp}": str(tmp_path)}
    args = [a for a in args]
    for i, a in enumerate(args):
        for k, v in fill.items():
            a = a.replace(k, v)
        args[i] = a
    out_dir = tmp_path / "run"
    res = veil(*args, "--out", str(out_dir), cwd=tmp_path)
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("veil: error: ") and message in lines[0], res.stderr
    assert "Traceback" not in res.stderr
    assert not out_dir.exists()


def test_train_end_to_end(tmp_path: Path) -> None:
    res = veil(
        "train",
        "configs/vit_digits.yaml",
        "train.epochs=1",
        "data.train_size=200",
        "data.test_size=50",
        "--out",
        str(tmp_path / "r"),
        "--quiet",
        cwd=Path(__file__).parent.parent,
    )
    assert res.returncode == 0, res.stderr
    summary = json.loads((tmp_path / "r/summary.json").read_text())
    assert summary["model"] == "vit-digits" and 0 <= summary["test_accuracy"] <= 1
    assert (tmp_path / "r/config.yaml").is_file() and (tmp_path / "r/checkpoints/model.safetensors").is_file()
