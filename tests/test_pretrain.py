"""`veil pretrain` and `model.init`: a checkpoint folder built offline and a run that starts from it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from veil.cli import main
from veil.config import load_config
from veil.errors import VeilError
from veil.models import create_model


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("pretrain") / "pre"
    argv = ["pretrain", "configs/pretrain/vit_lfw.yaml", "train.max_steps=3", "train.epochs=1"]
    assert main([*argv, "--out", str(out), "--quiet"]) == 0
    return out


def test_pretrain_writes_a_checkpoint_folder_that_init_loads(pretrained: Path) -> None:
    out = pretrained
    meta = json.loads((out / "pretrained.json").read_text())
    assert meta["model"] == "vit-digits" and meta["options"]["num_classes"] == 2  # LFW: faces vs non-faces
    assert meta["data"]["name"] == "lfw" and meta["train"]["steps"] == 3 and meta["wall_seconds"] > 0
    saved = load_file(str(out / "model.safetensors"))
    same = create_model("vit-digits", init=str(out))
    assert all(torch.equal(same.state_dict()[k], v) for k, v in saved.items())
    # fine-tuning on digits: 10 classes; everything but the head comes from the checkpoint
    torch.manual_seed(1)
    ten = create_model("vit-digits", init=str(out), num_classes=10)
    assert torch.equal(ten.patch_embed.weight, saved["patch_embed.weight"])
    assert torch.equal(ten.pos.weight, saved["pos.weight"])
    assert ten.head.weight.shape == (10, 64)
    # and a fresh model of the same seed differs from the pretrained one (the load did something)
    torch.manual_seed(1)
    assert not torch.equal(create_model("vit-digits", num_classes=10).patch_embed.weight, ten.patch_embed.weight)


def test_a_run_config_fine_tunes_from_model_init(tmp_path: Path, pretrained: Path) -> None:
    out = pretrained
    run = tmp_path / "ft"
    argv = ["train", "configs/pretrain/finetune_vit_digits.yaml", f"model.init={out}", "train.max_steps=2"]
    assert main([*argv, "--out", str(run), "--quiet"]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["model"] == "vit-digits"
    assert load_config(run).model["init"] == str(out)


def test_pretrained_decoder_loads_offline_with_shorter_sequences(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = create_model("llama-tiny", vocab_size=300, max_len=32, dim=32, depth=1, heads=2, mlp_hidden=48)
    from veil.models.pretrained import save

    save(model, "llama-tiny", tmp_path / "lm")
    short = create_model("llama-tiny", init=str(tmp_path / "lm"), max_len=16)  # a fine-tune's data: shorter
    assert short.cfg.max_len == 32 and torch.equal(short.tok.weight, model.tok.weight)
    with pytest.raises(VeilError, match="pretrained with max_len 32; the data needs 64"):
        create_model("llama-tiny", init=str(tmp_path / "lm"), max_len=64)


@pytest.mark.parametrize(
    ("init", "name", "opts", "match"),
    [
        ("missing", "vit-digits", {}, "is not a pretrained checkpoint folder"),
        ("pre", "vit-tiny", {}, "holds a 'vit-digits' model, not 'vit-tiny'"),
        ("pre", "vit-digits", {"dim": 32}, "pretrained with dim=64, this run asks for 32"),
        ("pre", "vit-digits", {"in_chans": 3}, "pretrained with in_chans=1"),
    ],
)
def test_bad_init_is_one_line(tmp_path: Path, pretrained: Path, init: str, name: str, opts: dict, match: str) -> None:
    folder = pretrained if init == "pre" else tmp_path / init
    with pytest.raises(VeilError, match=match) as err:
        create_model(name, init=str(folder), **opts)
    assert "\n" not in str(err.value)


def test_damaged_checkpoint_is_refused(tmp_path: Path, pretrained: Path) -> None:
    out = tmp_path / "copy"
    shutil.copytree(pretrained, out)
    blob = bytearray((out / "model.safetensors").read_bytes())
    blob[-1] ^= 0xFF
    (out / "model.safetensors").write_bytes(bytes(blob))
    with pytest.raises(VeilError, match="integrity"):
        create_model("vit-digits", init=str(out))


def test_pretrain_refuses_defenses(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["pretrain", "configs/pretrain/vit_lfw.yaml", "defense=mjp", "--out", str(tmp_path / "x"), "--quiet"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "without defenses" in err[0]
