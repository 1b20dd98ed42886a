"""A checkpoint is several files that must change together (weights, optimiser, streams,
`state.json`). A kill between two of them used to pair the newest weights with the previous
`state.json`: the resumed run replayed steps on weights that had already taken them (CI caught it
as `test_veil_train_killed_by_a_signal_mid_epoch_resumes_bit_identical` failing once in a few runs).

Here the kill lands at every file operation of the second checkpoint's publish in turn: whatever
is on disk afterwards, the reader gets one whole checkpoint, the first or the second, never a mix.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import veil.io as vio
from veil.training.checkpoint import load_streams, load_training_state, save_training_state


class Killed(Exception):
    pass


def _model_and_opt(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return model, opt


def _save(ckdir: Path, step: int) -> torch.nn.Module:
    model, opt = _model_and_opt(step)
    save_training_state(ckdir, model, opt, {"step": step}, {"stream": torch.tensor([step])})
    return model


def _operations(tmp_path: Path) -> int:
    """How many renames one publish makes (every file through a temporary name, then the move-in)."""
    calls = 0
    real = os.replace

    def counting(a, b):
        nonlocal calls
        calls += 1
        return real(a, b)

    vio.os.replace = counting
    try:
        _save(tmp_path / "count", 1)
    finally:
        vio.os.replace = real
    return calls


def test_a_kill_at_any_rename_of_a_publish_leaves_one_whole_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    total = _operations(tmp_path)
    assert total >= 4  # at least weights, optimiser, streams and state.json: cut points between them
    seen = set()
    real = os.replace
    for cut in range(total + 1):
        ckdir = tmp_path / f"cut{cut}"
        first = _save(ckdir, 1)
        done = 0

        def dying(a, b, _cut=cut):
            nonlocal done
            if done == _cut:
                raise Killed
            done += 1
            return real(a, b)

        monkeypatch.setattr(vio.os, "replace", dying)
        try:
            second = _save(ckdir, 2)
        except Killed:
            second = _model_and_opt(2)[0]
        monkeypatch.setattr(vio.os, "replace", real)
        model, opt = _model_and_opt(99)
        loop = load_training_state(ckdir, model, opt)
        assert loop is not None
        step = loop["step"]
        want = {1: first, 2: second}[step]
        assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), want.state_dict().values())), (
            f"kill at rename {cut}: state.json of step {step} with the weights of the other checkpoint"
        )
        assert int(load_streams(ckdir)["stream"]) == step
        assert not (ckdir / vio.STAGE).exists()
        seen.add(step)
    assert seen == {1, 2}  # early kills keep the first checkpoint, late ones complete the second


def test_a_publish_cut_mid_write_is_dropped_and_the_next_one_proceeds(tmp_path: Path) -> None:
    ckdir = tmp_path / "ck"
    _save(ckdir, 1)
    stage = ckdir / vio.STAGE
    stage.mkdir()
    (stage / "last.safetensors").write_bytes(b"half a file")  # no state.json: the write was cut
    model, opt = _model_and_opt(99)
    assert load_training_state(ckdir, model, opt) == {"step": 1}
    assert not stage.exists()
    second = _save(ckdir, 2)
    assert load_training_state(ckdir, model, opt) == {"step": 2}
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), second.state_dict().values()))
