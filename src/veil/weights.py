"""Which weights of a run folder a command reads, named, never guessed.

A run folder holds its finished model (``checkpoints/model.safetensors``, written with
``summary.json`` when training ends) and, while it trains, the last resumable checkpoint
(``checkpoints/last.safetensors`` with ``state.json``, whose loop counters give its step).
`veil attack`, `veil eval` and the audit read the finished model; a folder without one (training
was stopped, or its checkpoints were removed) is a one-line error that names what is there,
unless the user names the weights with ``--checkpoint``:

  last    the last checkpoint written (the finished model's step when training finished)
  STEP    the checkpoint of that step (veil keeps the finished model and the last checkpoint;
          0 is the seeded initial weights)
  init    the seeded initial weights the run started from (`veil.build.build_run`)

`choose` returns a `Weights`: the file to load (None: the initial weights), the step and how it
was chosen; commands record `Weights.record()` in their summary.json.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from veil.errors import VeilError

CHOICES = "last|STEP|init"
FINAL = "model.safetensors"
LAST = "last.safetensors"


@dataclass(frozen=True)
class Weights:
    """The weights a command reads: `path` (None: the seeded initial weights), their training
    `step`, `checkpoint` (``final`` | ``last`` | ``init`` | the step asked for) and whether
    training had `finished`."""

    path: Path | None
    step: int
    checkpoint: str
    finished: bool

    def record(self) -> dict[str, Any]:
        """What summary.json keeps: {checkpoint, step, finished}."""
        return {"checkpoint": self.checkpoint, "step": self.step, "finished": self.finished}

    def describe(self) -> str:
        """`final model (step 40)`, `checkpoint at step 12 (training unfinished)`, `initial weights (step 0)`."""
        if self.path is None:
            return "initial weights (step 0)"
        if self.finished and self.checkpoint in ("final", "last"):
            return f"final model (step {self.step})"
        return f"checkpoint at step {self.step} (training unfinished)"


def _step_of(state: dict[str, Any]) -> int | None:
    """The step (or round) a checkpoint's state.json records."""
    loop = state.get("loop") if isinstance(state.get("loop"), dict) else state
    for key in ("step", "round"):
        if isinstance(loop.get(key), int):
            return int(loop[key])
    return None


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return raw if isinstance(raw, dict) else None


def _finished_step(run_dir: Path, last_step: int | None) -> int | None:
    summary = _read_json(run_dir / "summary.json") or {}
    for key in ("steps", "rounds"):
        if isinstance(summary.get(key), int):
            return int(summary[key])
    return last_step


def choose(run_dir: str | Path, checkpoint: str | None = None) -> Weights:
    """The weights of `run_dir` to read: the finished model when `checkpoint` is None (a one-line
    `VeilError` naming what the folder holds when there is none), else the named checkpoint."""
    run_dir = Path(run_dir)
    ck = run_dir / "checkpoints"
    state = _read_json(ck / "state.json") if (ck / "state.json").is_file() else None
    last_step = _step_of(state) if state is not None else None
    has_last = (ck / LAST).is_file() and last_step is not None
    finished = (run_dir / "summary.json").is_file() and (ck / FINAL).is_file()
    final_step = _finished_step(run_dir, last_step) if finished else None
    if checkpoint is None:
        if finished:
            return Weights(ck / FINAL, int(final_step or 0), "final", True)
        raise VeilError(f"run folder '{run_dir}' has no finished model: {_holds(ck, last_step, has_last)}")
    what = str(checkpoint).strip().lower()
    if what == "init":
        return Weights(None, 0, "init", finished)
    if what == "last":
        if finished and (not has_last or last_step == final_step):
            return Weights(ck / FINAL, int(final_step or 0), "last", True)
        if has_last:
            return Weights(ck / LAST, int(last_step or 0), "last", False)
        raise VeilError(
            f"run folder '{run_dir}' has no checkpoint to read as --checkpoint last: {_holds(ck, None, False)}"
        )
    if not what.isdigit():
        raise VeilError(f"--checkpoint must be one of {CHOICES} (STEP: a whole number), got {checkpoint!r}")
    step = int(what)
    if step == 0:
        return Weights(None, 0, "0", finished)
    if finished and step == final_step:
        return Weights(ck / FINAL, step, str(step), True)
    if has_last and step == last_step:
        return Weights(ck / LAST, step, str(step), False)
    kept = sorted({s for s in (final_step, last_step if has_last else None) if s is not None} | {0})
    raise VeilError(
        f"run folder '{run_dir}' has no checkpoint at step {step}; it keeps steps {', '.join(map(str, kept))} "
        f"(--checkpoint {CHOICES})"
    )


def _holds(ck: Path, last_step: int | None, has_last: bool) -> str:
    """What a folder without a finished model holds, and the ways on."""
    if has_last:
        return (
            f"training stopped at step {last_step} ({ck / LAST}); finish it with the same `veil train` command, "
            f"or name the weights with --checkpoint last (step {last_step}) or --checkpoint init"
        )
    where = "its checkpoints folder is missing" if not ck.is_dir() else f"'{ck}' holds no checkpoint"
    return f"{where}; retrain it, or name the seeded initial weights with --checkpoint init"
