"""Time the quickstart on this machine, idle and beside one CPU-bound process, and write the
line into README.md (between <!-- quickstart-time:start/end -->). Issue 23's goal: <= 2 minutes
idle, <= 5 minutes beside one other CPU-bound process, the same numbers both times.

    python scripts/time_quickstart.py [--keep DIR]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from readme_numbers import replace_block

ROOT = Path(__file__).resolve().parent.parent


def timed_audit(out: Path) -> tuple[float, float]:
    """(wall seconds, one-minute load when it started) of `veil audit --out OUT --quiet`."""
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "veil.cli", "audit", "--out", str(out), "--quiet"], check=True)
    return time.perf_counter() - t0, load


def numbers(path: Path) -> dict:
    """Every number of a summary but timings (the two runs must agree on these)."""

    def keep(x):
        if isinstance(x, dict):
            return {k: keep(v) for k, v in x.items() if "second" not in k and k not in ("overhead", "versions")}
        return [keep(v) for v in x] if isinstance(x, list) else x

    return keep(json.loads((path / "summary.json").read_text())["tasks"])


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        idle, idle_load = timed_audit(Path(tmp) / "idle")
        hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            time.sleep(3)
            busy, busy_load = timed_audit(Path(tmp) / "busy")
        finally:
            hog.kill()
        same = numbers(Path(tmp) / "idle") == numbers(Path(tmp) / "busy")
    line = (
        f"On this machine ({os.cpu_count()} cores) `veil audit --out runs/audit --quiet` took **{idle:.0f} s** "
        f"(one-minute load {idle_load:.1f} when it started) and **{busy:.0f} s** beside one CPU-bound process "
        f"(`python -c 'while True: pass'`), with {'the same numbers both times' if same else 'DIFFERENT numbers'} "
        "(measured by `python scripts/time_quickstart.py`)."
    )
    print(line)
    readme = ROOT / "README.md"
    readme.write_text(replace_block(readme.read_text(), "quickstart-time", line))


if __name__ == "__main__":
    main()
