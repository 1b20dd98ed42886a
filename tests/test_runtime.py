"""Threads: what the machine can give, pinned by the environment, kept across a resume."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from veil.config import load_config
from veil.runtime import current_load, free_cores, resolve_threads, usable_cores
from veil.training.loop import train


def test_free_cores_is_the_cores_minus_the_load_and_at_least_one() -> None:
    n = usable_cores()
    assert free_cores(0.0) == n
    assert free_cores(0.6) == max(1, n - 1)
    assert free_cores(n + 5.0) == 1


def test_the_load_is_read_now() -> None:
    """A CPU-bound process started a moment ago counts at once (the one-minute load average would
    still read it as ~0)."""
    import subprocess
    import sys

    def hog_ticks() -> int:  # the CPU the hog has used so far, in clock ticks (utime + stime)
        return sum(int(x) for x in Path(f"/proc/{hog.pid}/stat").read_text().rsplit(")", 1)[1].split()[11:13])

    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        while hog_ticks() < 20:  # it is running (counted CPU ticks, not a sleep)
            assert hog.poll() is None
            time.sleep(0.01)
        assert current_load(0.5) >= 0.6  # the hog alone is one core (other work only adds)
    finally:
        hog.kill()
        hog.wait()


def test_this_process_own_cpu_time_is_subtracted(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hand-computed: over 0.5 s the machine's cores were busy 150 of 200 ticks (1.5 cores of 2)
    and this process used 0.5 s of CPU (1 core): others use 0.5 cores."""
    import veil.runtime as rt

    jiffies, own, clock = iter([(1000, 4000), (1150, 4200)]), iter([3.0, 3.5]), iter([10.0, 10.5])
    monkeypatch.setattr(rt, "_cpu_jiffies", lambda: next(jiffies))
    monkeypatch.setattr(rt, "_own_seconds", lambda: next(own))
    monkeypatch.setattr(rt.time, "monotonic", lambda: next(clock))
    monkeypatch.setattr(rt.time, "sleep", lambda s: None)
    monkeypatch.setattr(rt.os, "cpu_count", lambda: 2)
    assert current_load(0.5) == pytest.approx(0.5)


def test_an_explicit_setting_wins_then_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert resolve_threads(2) == 2
    assert resolve_threads(0) == 3
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr("veil.runtime.current_load", lambda: usable_cores() + 1.0)
    assert resolve_threads(0) == 1  # a saturated machine: one thread, not one per core


def test_a_resumed_run_keeps_the_thread_count_its_first_part_chose(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import veil.training.loop as loop

    args = ["model=vit-digits", "model.depth=1", "model.dim=32", "model.heads=2", "data.train_size=64"]
    cfg = load_config(None, [*args, "data.test_size=16", "train.batch_size=32", "train.epochs=2"])
    real, seen = loop.client_step, []

    def step(*a, **k):
        seen.append(torch.get_num_threads())
        if k["step"] == 3 and len(seen) == 4:  # dies in epoch 2, after epoch 1's checkpoint
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(loop, "client_step", step)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    with pytest.raises(KeyboardInterrupt):
        train(cfg, tmp_path / "r", progress=False)
    assert json.loads((tmp_path / "r" / "checkpoints" / "state.json").read_text())["loop"]["threads"] == 2
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the machine got busy: a fresh run would take one
    train(cfg, tmp_path / "r", progress=False)
    assert seen == [2, 2, 2, 2, 2, 2]  # steps 0-3, then steps 2-3 again after the resume
    train(cfg, tmp_path / "fresh", progress=False)
    assert seen[6:] == [1, 1, 1, 1]
    torch.set_num_threads(1)
