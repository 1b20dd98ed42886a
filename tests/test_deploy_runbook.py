"""docs/federated.md's deployment runbook, run as written: its bash blocks in order (TLS and
SuperNode authentication on), the *background* ones (SuperLink, two SuperNodes) as processes on
127.0.0.1 that are killed at the end, then the run folder and what is left running are checked."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from veil.federated.cluster import free_port

ROOT = Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"<!-- runbook: (\S+)( background)? -->\n```bash\n(.*?)\n```", re.S)


def runbook() -> list[tuple[str, bool, str]]:
    text = (ROOT / "docs" / "federated.md").read_text()
    return [(m.group(1), bool(m.group(2)), m.group(3)) for m in BLOCK.finditer(text)]


def test_the_runbook_has_its_steps() -> None:
    steps = runbook()
    names = [n for n, _, _ in steps]
    assert names[0] == "env" and {"link", "silo", "silo0", "silo1"} <= set(names)
    assert [n for n, bg, _ in steps if bg] == ["link", "silo0", "silo1"]
    every = "\n".join(b for _, _, b in steps)
    assert "--enable-supernode-auth" in every and "--ssl-certfile" in every and "--insecure" not in every
    assert "--database" in every and "--auth-supernode-private-key" in every


@pytest.mark.slow
def test_the_runbook_runs_as_written(tmp_path: Path) -> None:
    work = tmp_path / "work"
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("FLWR_")},
        "VEIL": str(ROOT),
        "WORK": str(work),
        "LINK": "127.0.0.1",
        "LINK_PORT": str(free_port()),
        "SILO0_PORT": str(free_port()),
        "SILO1_PORT": str(free_port()),
    }
    steps = runbook()
    prefix = steps[0][2] + "\n"
    procs: list[subprocess.Popen] = []
    logs = tmp_path / "logs"
    logs.mkdir()
    try:
        for i, (name, background, block) in enumerate(steps[1:], 1):
            log = (logs / f"{i:02d}-{name}.log").open("wb")
            cmd = ["bash", "-euo", "pipefail", "-c", prefix + block]
            if background:
                procs.append(
                    subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
                )
                continue
            r = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=900)
            assert r.returncode == 0, (name, (logs / f"{i:02d}-{name}.log").read_text()[-3000:])
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
    run = work / "run"
    assert json.loads((run / "status.json").read_text())["status"] == "finished"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["clients"] == 2 and summary["rounds"] == 4 and summary["client_failures"] == 0
    # a stopped SuperNode or SuperLink shuts down gracefully; the wait is a safety net, the check is that none is left
    end = time.time() + 30
    while (left := alive(work)) and time.time() < end:
        time.sleep(0.5)
    assert not left, left


def alive(work: Path) -> dict[str, str]:
    """pid -> command line of every process still running that names the runbook's folder."""
    out = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            with contextlib.suppress(OSError):
                cmd = (d / "cmdline").read_bytes()
                if str(work).encode() in cmd:
                    out[d.name] = cmd.replace(b"\0", b" ").decode()[:200]
    return out
