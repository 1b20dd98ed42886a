"""Training: seeded and repeatable, checkpoints as safetensors, resume equals uninterrupted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import TINY_RUN
from veil.build import build_run, load_run
from veil.config import load_config
from veil.errors import VeilError
from veil.io import load_model_weights, save_model_weights
from veil.training.loop import train

TINY = TINY_RUN


def test_run_folder_contents_and_repeatability(tmp_path: Path) -> None:
    cfg = load_config(None, TINY)
    a = train(cfg, tmp_path / "a", progress=False)
    b = train(cfg, tmp_path / "b", progress=False)
    for key in ("test_accuracy", "train_seconds", "model", "params"):
        assert key in a
    assert a["test_accuracy"] == b["test_accuracy"]
    wa = load_file(str(tmp_path / "a/checkpoints/model.safetensors"))
    wb = load_file(str(tmp_path / "b/checkpoints/model.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    events = [json.loads(line) for line in (tmp_path / "a/metrics.jsonl").read_text().splitlines()]
    assert [e["epoch"] for e in events if e["event"] == "eval"] == [1, 2]
    assert load_config(tmp_path / "a") == cfg  # the resolved config reloads to the same run


def test_resume_after_interruption_matches_uninterrupted(tmp_path: Path) -> None:
    cfg = load_config(None, TINY + ["train.epochs=3"])
    full = train(cfg, tmp_path / "full", progress=False)
    # interrupted run: train 1 epoch's worth by stopping after epoch 1, then resume
    cut = load_config(None, TINY + ["train.epochs=3"])
    model, data, defenses = build_run(cut)
    import veil.training.loop as loop

    calls = {"n": 0}
    real_eval = loop.evaluate

    def dying_eval(*a, **k):  # the process "dies" right after the first epoch's checkpoint
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real_eval(*a, **k)

    loop.evaluate = dying_eval
    try:
        with pytest.raises(KeyboardInterrupt):
            train(cut, tmp_path / "cut", model=model, data=data, defenses=defenses, progress=False)
    finally:
        loop.evaluate = real_eval
    assert json.loads((tmp_path / "cut/checkpoints/state.json").read_text())["loop"]["epoch"] == 1
    resumed = train(cut, tmp_path / "cut", progress=False)
    assert resumed["test_accuracy"] == full["test_accuracy"]
    wa = load_file(str(tmp_path / "full/checkpoints/model.safetensors"))
    wb = load_file(str(tmp_path / "cut/checkpoints/model.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_checkpoint_roundtrip_and_load_run(tmp_path: Path) -> None:
    cfg = load_config(None, TINY + ["train.epochs=1"])
    train(cfg, tmp_path / "r", progress=False)
    _, model, data, _ = load_run(tmp_path / "r")
    saved = load_file(str(tmp_path / "r/checkpoints/model.safetensors"))
    assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items() if k in saved)


def test_tied_weights_roundtrip(tmp_path: Path) -> None:
    from veil.models import create_model

    m = create_model("gpt-tiny", depth=1, tie_weights=True, vocab_size=500)
    save_model_weights(m, tmp_path / "m.safetensors")
    m2 = create_model("gpt-tiny", depth=1, tie_weights=True, vocab_size=500)
    load_model_weights(m2, tmp_path / "m.safetensors")
    assert torch.equal(m2.tok.weight, m.tok.weight) and m2.lm_head.weight is m2.tok.weight


def test_not_a_checkpoint_is_refused(tmp_path: Path) -> None:
    from veil.models import create_model

    bad = tmp_path / "evil.safetensors"
    bad.write_bytes(b"\x80\x04pickle-not-safetensors")
    with pytest.raises(VeilError, match="is not a readable safetensors file"):
        load_model_weights(create_model("vit-digits"), bad)


def test_other_config_in_run_folder_is_refused(tmp_path: Path) -> None:
    train(load_config(None, TINY + ["train.epochs=1"]), tmp_path / "r", progress=False)
    with pytest.raises(VeilError, match="holds a different config"):
        train(load_config(None, TINY + ["train.epochs=2"]), tmp_path / "r", progress=False)


def test_language_model_reports_perplexity(tmp_path: Path) -> None:
    cfg = load_config(
        None,
        [
            "model=gpt-tiny",
            "model.depth=1",
            "data=sst2",
            "data.tokenizer=word",
            "data.max_len=16",
            "data.train_size=128",
            "data.test_size=32",
            "train.epochs=1",
        ],
    )
    s = train(cfg, tmp_path / "lm", progress=False)
    assert s["test_perplexity"] > 1 and 0 <= s["test_accuracy"] <= 1
