"""Exact resume for split learning (`veil.federated.split.checkpoint`): a run interrupted at a step
drawn from a fixed seed and rerun on its folder ends on the weights (the server's body; every client's head, tail,
Adam state and permutation keys), metrics, epoch log and byte counts of an uninterrupted run; the
keys stay in the clients' own folders, never in the server's checkpoint."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from helpers import split_config as cfg
from veil.errors import VeilError
from veil.federated.split.spec import load_split_spec

ROOT = Path(__file__).resolve().parent.parent
TINY = [
    "model.dim=16",
    "model.depth=1",
    "model.heads=2",
    "train.batch_size=128",
    "split.epochs=2",
    "split.clients_per_task=1",
    "split.tasks=[classify, segment]",
    "split.checkpoint_every=1",
]


def overrides(protocol: str, *extra: str) -> list[str]:
    return [*TINY, f"split.protocol={protocol}", *([] if protocol == "pfesta" else ["defense=[]"]), *extra]


def final_state(run: Path) -> dict[str, torch.Tensor]:
    """The server's body and optimiser, and every client's last snapshot (head, tail, Adam, keys)."""
    steps = json.loads((run / "checkpoints" / "state.json").read_text())["step"]
    out = {f"server/{k}": v for k, v in load_file(run / "checkpoints" / "body.safetensors").items()}
    if (run / "checkpoints" / "optimizer.safetensors").is_file():
        out |= {f"opt/{k}": v for k, v in load_file(run / "checkpoints" / "optimizer.safetensors").items()}
    for d in sorted((run / "clients").iterdir()):
        out |= {f"{d.name}/{k}": v for k, v in load_file(d / f"step-{steps:08d}.safetensors").items()}
    return out


def assert_same_run(a: Path, b: Path) -> None:
    sa, sb = final_state(a), final_state(b)
    assert sa.keys() == sb.keys() and any(k.endswith("/keys") for k in sa) == ("pfesta" in a.name)
    differ = [k for k in sa if not torch.equal(sa[k], sb[k])]
    assert not differ, f"resumed run differs in {differ[:5]}"
    ja, jb = (json.loads((r / "summary.json").read_text()) for r in (a, b))
    ja.pop("seconds"), jb.pop("seconds")
    assert ja == jb
    assert (a / "metrics.jsonl").read_text() == (b / "metrics.jsonl").read_text()


class Counter:
    """Counts the server's training exchanges (checkpoint messages aside) and raises
    KeyboardInterrupt at exchange `stop`; notes the count at the first checkpoint."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, stop: int = 0) -> None:
        from veil.federated.split import server_app

        self.n, self.stop, self.first_checkpoint = 0, stop, 0
        real = server_app.Exchange.__call__

        def call(ex, node, mtype, phase="train", **records):  # type: ignore[no-untyped-def]
            if mtype == "train.checkpoint":
                # not counted: a stop must land after the whole checkpoint (every client's
                # message, then the server's state.json), never between two clients' messages
                self.first_checkpoint = self.first_checkpoint or self.n
            elif mtype.startswith("train.") and mtype != "train.restore":
                self.n += 1
                if self.n == self.stop:
                    raise KeyboardInterrupt
            return real(ex, node, mtype, phase, **records)

        monkeypatch.setattr(server_app.Exchange, "__call__", call)


def uninterrupted(tmp: Path, monkeypatch: pytest.MonkeyPatch, protocol: str, *extra: str) -> tuple[Path, Counter]:
    from veil.federated.split.run import run_split

    run = tmp / f"{protocol}-a"
    with monkeypatch.context() as m:
        count = Counter(m)
        run_split(load_split_spec(cfg(tmp), overrides(protocol, *extra)), run)
    return run, count


def interrupted_then_resumed(
    tmp: Path, monkeypatch: pytest.MonkeyPatch, protocol: str, ref: Counter, *extra: str
) -> Path:
    """Run `protocol` into tmp/<protocol>-b, raising KeyboardInterrupt in the server at a
    training exchange after the first checkpoint, drawn from a fixed seed per case, then rerun it on the same folder."""
    from veil.federated.split.run import run_split

    spec = load_split_spec(cfg(tmp), overrides(protocol, *extra))
    run = tmp / f"{protocol}-b"
    seed = f"stop-{protocol}-{','.join(extra)}"  # a fixed stop per case: a failure reruns as it failed
    stop = random.Random(seed).randrange(ref.first_checkpoint + 1, ref.n + 1)
    with monkeypatch.context() as m:
        Counter(m, stop)
        with pytest.raises(KeyboardInterrupt):
            run_split(spec, run)
    assert not (run / "summary.json").exists()
    assert json.loads((run / "checkpoints" / "state.json").read_text())["step"] > 0, (stop, seed)
    run_split(spec, run)
    return run


def test_pfesta_interrupted_at_a_random_step_resumes_bit_for_bit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """p-FeSTA with the permutation defense and the default client-held secret (one process, so one
    secret for both runs): same body, heads, tails, Adam states, keys, metrics and bytes."""
    a, count = uninterrupted(tmp_path, monkeypatch, "pfesta")
    b = interrupted_then_resumed(tmp_path, monkeypatch, "pfesta", count)
    assert_same_run(a, b)
    # the keys are in the clients' folders and nowhere in the server's checkpoint or files
    keys = [load_file(f)["keys/keys"].numpy().astype(np.int64) for f in (b / "clients").rglob("*.safetensors")]
    assert keys and all(k.ndim == 2 for k in keys)
    rows = {r.tobytes() for k in keys for r in k} | {r.astype(np.int32).tobytes() for k in keys for r in k}
    server_side = [f for f in b.rglob("*") if f.is_file() and "clients" not in f.relative_to(b).parts]
    assert any(f.parent.name == "checkpoints" for f in server_side)
    for f in server_side:
        data = f.read_bytes()
        assert not any(r in data for r in rows), f"a permutation key is in the server's {f}"
    # a finished run is not trained again: the rerun returns its summary
    from veil.federated.split.run import run_split

    again = run_split(load_split_spec(cfg(tmp_path), overrides("pfesta")), b)
    assert again == json.loads((b / "summary.json").read_text())


def test_a_missing_or_damaged_client_snapshot_is_one_line(tmp_path: Path) -> None:
    from flwr.app import ArrayRecord, ConfigRecord, RecordDict

    from veil.federated.split.checkpoint import load_client_state, save_client_state

    state = RecordDict({"keys": ArrayRecord({"keys": torch.arange(6).reshape(2, 3)}), "n": ConfigRecord({"n": 2})})
    for step in (1, 2, 3):
        save_client_state(state, tmp_path, step, "spec")
    assert sorted(p.name for p in tmp_path.glob("step-*.json")) == ["step-00000002.json", "step-00000003.json"]
    back = load_client_state(tmp_path, 3, "spec")
    assert torch.equal(back["keys"].to_torch_state_dict()["keys"], torch.arange(6).reshape(2, 3))
    assert int(back["n"]["n"]) == 2
    with pytest.raises(VeilError, match="no intact snapshot of step 1"):
        load_client_state(tmp_path, 1, "spec")
    with pytest.raises(VeilError, match="different run config"):
        load_client_state(tmp_path, 3, "other spec")
    f = tmp_path / "step-00000003.safetensors"
    f.write_bytes(f.read_bytes()[:-5])
    with pytest.raises(VeilError, match="integrity check"):
        load_client_state(tmp_path, 3, "spec")


@pytest.mark.slow
@pytest.mark.parametrize("protocol", ["sl", "festa", "fl"])
def test_split_protocols_interrupted_resume_bit_for_bit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, protocol: str
) -> None:
    extra = ["split.unify_every=2"] if protocol == "fl" else []
    a, count = uninterrupted(tmp_path, monkeypatch, protocol, *extra)
    assert_same_run(a, interrupted_then_resumed(tmp_path, monkeypatch, protocol, count, *extra))


@pytest.mark.slow
@pytest.mark.ci_slow  # CI's slow stage: the one split run killed for real (SIGKILL) and rerun
def test_veil_split_killed_and_rerun_ends_on_the_uninterrupted_weights(tmp_path: Path) -> None:
    """`veil split` SIGKILLed after a random number of checkpoints, then the same command again
    (new processes: `split.secret=seeded`, so the keys of the three processes agree)."""
    config = cfg(tmp_path)
    args = [str(config), *overrides("pfesta", "split.secret=seeded", "split.epochs=3")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def veil(out: Path) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "veil.cli", "split", *args, "--out", str(out)]
        return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    a, b = tmp_path / "pfesta-a", tmp_path / "pfesta-b"
    assert veil(a).wait(600) == 0
    state = b / "checkpoints" / "state.json"
    p, target = veil(b), random.Random("kill-pfesta").randrange(1, 8)
    end = time.time() + 600  # a safety net for a child that hangs, not the check
    while not (state.is_file() and json.loads(state.read_text())["step"] >= target):
        assert p.poll() is None and time.time() < end, (p.returncode, p.stderr.read() if p.stderr else "")
        time.sleep(0.05)
    p.send_signal(signal.SIGKILL)
    p.wait(60)
    assert not (b / "summary.json").exists()
    rerun = veil(b)
    assert rerun.wait(600) == 0, rerun.stderr.read() if rerun.stderr else ""
    assert_same_run(a, b)
