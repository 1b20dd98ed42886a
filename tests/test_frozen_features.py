"""`train.frozen_features` (veil.training.frozen): training the head on the frozen encoder's output,
computed once, is the same training as re-running the encoder every step — same DP-SGD weights
(clipping and noise included), same test accuracy — and it is refused, with one line, wherever
the encoder's output is not a fixed function of the sample."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from veil.config import from_dict
from veil.errors import VeilError
from veil.training.loop import train

BASE = {
    "model": {"name": "hf-bert", "dim": 32, "depth": 2, "heads": 2, "dropout": 0.0},
    "data": {"name": "sst2", "max_len": 16, "train_size": 96, "test_size": 32},
}
DP = {"name": "dpsgd", "noise_multiplier": 1.0, "clip": 0.5, "trainable": "classifier", "seed": 3, "chunk": 16}


def _run(tmp_path, name: str, frozen: bool, defense=DP, model=None) -> tuple[dict, dict]:
    cfg = from_dict(
        {
            **BASE,
            "model": model or BASE["model"],
            "defense": defense,
            "train": {"epochs": 2, "batch_size": 32, "lr": 0.05, "threads": 1, "frozen_features": frozen},
        }
    )
    summary = train(cfg, tmp_path / name, progress=False)
    return summary, load_file(str(tmp_path / name / "checkpoints" / "model.safetensors"))


def test_cached_features_train_the_same_dp_head(tmp_path) -> None:
    full, w_full = _run(tmp_path, "full", False)
    fast, w_fast = _run(tmp_path, "fast", True)
    head = [k for k in w_full if "classifier" in k]
    assert head and all(torch.allclose(w_full[k], w_fast[k], atol=1e-5) for k in head)
    assert all(torch.equal(w_full[k], w_fast[k]) for k in w_full if k not in head)  # the encoder stays frozen
    start = _run(tmp_path, "none", False, defense={**DP, "noise_multiplier": 0.0})[1]
    assert not torch.allclose(start[head[0]], w_fast[head[0]], atol=1e-3)  # the noise did reach the head
    assert fast["test_accuracy"] == full["test_accuracy"]
    assert fast["privacy"]["epsilon"] == full["privacy"]["epsilon"] and fast["steps"] == full["steps"]


@pytest.mark.parametrize(
    "defense,model,match",
    [
        ({**DP, "trainable": "layer\\.1\\.|classifier"}, None, "parameters outside the classifier train"),
        ([DP, {"name": "mjp", "gamma": 0.3}], None, "defense mjp changes the forward"),
        (DP, {**BASE["model"], "dropout": 0.1}, "dropout .* is active before the head"),
        ("none", None, "parameters outside the classifier train"),
    ],
)
def test_refused_where_the_encoder_output_is_not_fixed(tmp_path, defense, model, match: str) -> None:
    with pytest.raises(VeilError, match=f"^train.frozen_features: {match}"):
        _run(tmp_path, "x", True, defense=defense, model=model)
