"""scripts/check_src_text.py: docstrings and comments carry no measurements or history."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "check_src_text.py"

BAD = '''"""Rank the candidates (measured on MiniLM batch 16: 104 of 141 pinned, issue 17)."""

X = 1  # the limit was 5 before; previously the search took 38 s at 2 threads


def f() -> str:
    """The fast path: 5.2 ms instead of 11.6 ms per call (2x faster), ranks first at 87 % of the positions."""
    return "measured on MiniLM: was 5 (issue 17)"  # a string the code prints is not a docstring
'''

GOOD = '''"""Rank the candidates by the gradient match; the true token ranks first where the layer reads it.

An upstream bug (pytorch#164759) breaks tied weights. TPR at 0.1 % and 1 % FPR; a cell may exceed its
budget by more than 20 % only when flagged; PSNR >= 30 dB counts as a copy.
"""

X = 1  # the limit; the step time is measured once per task and cached


def f() -> str:
    """Say when no attack measured leakage; the stage line reads `veil: span done in 95 s`."""
    return "measured on MiniLM: was 5 (issue 17)"
'''


def run(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), str(path)], capture_output=True, text=True, cwd=ROOT)


def test_flags_figures_and_history_in_docstrings_and_comments(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(BAD)
    out = run(bad)
    assert out.returncode == 1
    flagged = {int(line.split(":")[1]) for line in out.stdout.splitlines() if line.startswith(str(bad))}
    assert flagged == {1, 3, 7}  # the module docstring, the comment, the function docstring; not line 8's string
    rules = {r for line in out.stdout.splitlines() if "[" in line for r in line.split("[")[1].split("]")[0].split(",")}
    assert rules == {"issue", "measured", "count", "was-N", "history", "timing", "speedup", "score"}


def test_passes_docstrings_that_say_what_and_why(tmp_path: Path) -> None:
    good = tmp_path / "good.py"
    good.write_text(GOOD)
    out = run(good)
    assert out.returncode == 0, out.stdout
    assert out.stdout == ""


def test_a_missing_path_is_one_line() -> None:
    out = run(ROOT / "no-such-folder")
    assert out.returncode == 1
    assert out.stderr.strip() == f"check_src_text: no such file or folder: {ROOT / 'no-such-folder'}"


def test_the_package_passes() -> None:
    out = run(ROOT / "src" / "veil")
    assert out.returncode == 0, out.stdout
