"""Run-folder safety: one writer per folder, failed starts that block nothing, and checkpoints or
cached results that fail their integrity check are never silently reused."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from veil.cli import main
from veil.errors import VeilError
from veil.runlock import LOCK_NAME, hold, holds_progress

ROOT = Path(__file__).resolve().parent.parent
TINY = [
    str(ROOT / "configs" / "vit_digits.yaml"),
    "model.depth=1",
    "model.dim=16",
    "data.train_size=64",
    "data.test_size=20",
    "--quiet",
]


def veil(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "veil.cli", *args], capture_output=True, text=True, timeout=300)


def test_second_writer_stops_at_once_naming_the_holder(tmp_path: Path) -> None:
    out = tmp_path / "run"
    with hold(out):
        res = veil("train", *TINY, "--out", str(out))  # it returns while the lock is still held here
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and f"in use by another veil process (pid {os.getpid()})" in lines[0], lines
    assert not (out / "config.yaml").exists()


def test_second_writer_tries_the_lock_once_without_blocking(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """It does not wait for the holder: one non-blocking attempt, no retry, no sleep (counted, not
    timed; flock locks of two open files conflict within one process too)."""
    import veil.runlock as runlock

    out = tmp_path / "run"
    real, ops = runlock.fcntl.flock, []
    with hold(out):
        monkeypatch.setattr(runlock.fcntl, "flock", lambda fd, op: (ops.append(op), real(fd, op))[1])
        monkeypatch.setattr(time, "sleep", lambda s: pytest.fail(f"the second writer slept {s} s"))
        assert main(["train", *TINY, "--out", str(out)]) == 2
        monkeypatch.undo()
    assert ops == [runlock.fcntl.LOCK_EX | runlock.fcntl.LOCK_NB], ops
    assert "in use by another veil process" in capsys.readouterr().err
    assert not (out / "config.yaml").exists()


def test_two_trainings_on_one_folder_the_first_finishes_unharmed(tmp_path: Path) -> None:
    out = tmp_path / "run"
    first = subprocess.Popen(
        [sys.executable, "-m", "veil.cli", "train", *TINY, "train.epochs=3", "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    while not (out / LOCK_NAME).is_file() and first.poll() is None:
        time.sleep(0.02)
    second = veil("train", *TINY, "train.epochs=3", "--out", str(out))
    assert first.wait(timeout=300) == 0, first.stderr.read() if first.stderr else ""
    assert second.returncode == 2 and "in use by another veil process" in second.stderr
    epochs = [
        json.loads(line)["epoch"] for line in (out / "metrics.jsonl").read_text().splitlines() if '"eval"' in line
    ]
    assert epochs == [1, 2, 3]
    assert not (out / LOCK_NAME).exists()


def test_the_lock_goes_with_a_killed_holder(tmp_path: Path) -> None:
    out = tmp_path / "run"
    code = f"from veil.runlock import hold\nwith hold({str(out)!r}):\n    print('held', flush=True)\n    import time; time.sleep(60)\n"
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    with pytest.raises(VeilError, match=f"pid {holder.pid}"), hold(out):
        pass
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    with hold(out):  # the kernel released it; the stale file blocks nothing
        assert (out / LOCK_NAME).read_text().strip() == str(os.getpid())


def test_a_run_that_failed_before_its_first_step_blocks_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.yaml").write_text("model: {name: vit-digits, dim: 8}\ntrain: {epochs: 7}\n")  # what it left
    assert not holds_progress(out)
    assert main(["train", *TINY, "train.max_steps=1", "--out", str(out)]) == 0
    assert (out / "summary.json").is_file()
    # a folder with progress still refuses a different config
    code = main(["train", *TINY, "train.max_steps=2", "--out", str(out)])
    assert code == 2 and "holds a different config" in capsys.readouterr().err


def test_a_corrupt_final_checkpoint_is_rebuilt_not_reused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    assert main(["train", *TINY, "train.max_steps=2", "--out", str(out)]) == 0
    first = json.loads((out / "summary.json").read_text())
    model = out / "checkpoints" / "model.safetensors"
    good = model.read_bytes()
    model.write_bytes(good[:-8] + bytes(8))
    capsys.readouterr()
    assert main(["train", *TINY, "train.max_steps=2", "--out", str(out)]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"veil: checkpoint '{model}' fails its integrity check; rebuilding it from the run's last checkpoint"
    ]
    assert model.read_bytes() == good  # the same weights, from the verified last checkpoint
    assert json.loads((out / "summary.json").read_text()) == first


def test_a_corrupt_checkpoint_is_refused_by_attack_and_eval(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from veil.build import load_run

    out = tmp_path / "run"
    assert main(["train", *TINY, "train.max_steps=1", "--out", str(out)]) == 0
    model = out / "checkpoints" / "model.safetensors"
    model.write_bytes(model.read_bytes()[:-1] + b"\x01")
    with pytest.raises(VeilError, match="fails its integrity check"):
        load_run(out)


def test_a_corrupt_cached_cell_is_recomputed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from veil.experiments.audit import _reusable
    from veil.io import write_checked_text

    cell = tmp_path / "seed0.json"
    assert not _reusable(cell)
    write_checked_text(cell, json.dumps({"metrics": {"psnr": 30.0}}))
    assert _reusable(cell)
    cell.write_text(json.dumps({"metrics": {"psnr": 99.0}}))
    assert not _reusable(cell)
    assert "fails its integrity check; recomputing it" in capsys.readouterr().err


def test_a_bad_input_leaves_no_folders_behind(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "runs" / "deep" / "run"
    assert main(["train", *TINY, "train.batch_size=0", "--out", str(out)]) == 2
    assert not (tmp_path / "runs").exists()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.is_file() and stat.read_text().split(") ")[-1].startswith("Z"))


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads worker processes from /proc")
def test_an_audit_killed_by_a_signal_takes_its_workers_with_it(tmp_path: Path) -> None:
    """`kill -9` of a parallel audit (its workers get no signal): the workers end within seconds
    instead of training on into run folders whose lock their audit no longer holds. The audit is
    killed once both workers have started (each runs a task that leaves its pid in `tmp_path`): a
    worker still importing on a busy machine has not started its watch yet."""
    code = (
        "import sys, time\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from helpers import mark_and_sleep\n"
        "from veil.experiments.audit import _pool\n"
        "pool = _pool(2)\n"
        f"futures = [pool.submit(mark_and_sleep, {str(tmp_path)!r}, 3600) for _ in range(2)]\n"
        "time.sleep(3600)\n"
    )
    audit = subprocess.Popen([sys.executable, "-c", code])
    started = time.monotonic()  # a safety net for a worker that never starts, not the check
    while len(list(tmp_path.iterdir())) < 2 and time.monotonic() - started < 240 and audit.poll() is None:
        time.sleep(0.2)
    workers = [int(p.name) for p in tmp_path.iterdir()]
    assert len(workers) == 2 and all(_alive(p) for p in workers), f"workers did not start: {workers}"
    audit.send_signal(signal.SIGKILL)
    audit.wait()
    # the workers' task lasts an hour: a worker alive when this safety net ends did not end with its
    # audit (the check is that they end, not how fast: they look for their parent twice a second)
    deadline = time.monotonic() + 60
    while any(_alive(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [p for p in workers if _alive(p)]
    for p in left:  # do not leave them behind if the test fails
        os.kill(p, signal.SIGKILL)
    assert not left, f"workers {left} outlived their killed audit"
