"""One writer per run folder: an exclusive lock that every command writing a run folder takes.

`hold(folder)` locks `folder/.veil.lock` (fcntl.flock, not blocking): a second veil process on
the same folder stops at once with one line naming the holder's PID. The kernel drops the lock
when the holder exits, however it exits (an exception, Ctrl-C, kill -9), so a stale lock file
never blocks anything. On release the lock file is removed, and a folder this call created and
that is still empty is removed too, with the empty parents it made (a bad input leaves nothing behind).

An existing folder that holds files but nothing a veil command writes (a user's own folder) is
refused in one line (`check_ours`), as is one the process cannot write in: nothing is written there.

`holds_progress(folder)`: whether a folder holds anything a rerun would reuse (a checkpoint,
events, results) — a folder with nothing but a resolved config from a run that failed before its
first step does not, and a corrected command may take it over.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from veil.errors import VeilError

LOCK_NAME = ".veil.lock"
#: files a run writes before its first step: they record what it meant to do, not progress
NOT_PROGRESS = frozenset({LOCK_NAME, "config.yaml", "scenario.yaml"})
#: what a folder written by a veil command holds at its top (`check_ours`): run, audit, attack, pretrain
OURS = frozenset(
    {"config.yaml", "scenario.yaml", "summary.json", "metrics.jsonl", "checkpoints", "runs", "cells", "features"}
    | {"pretrained.json", "run", "eval", "report.md", "report.html"}
)


@contextmanager
def hold(folder: str | Path) -> Iterator[Path]:
    """Hold the exclusive write lock on run folder `folder` (created if missing) while in the block."""
    folder = Path(folder)
    created = [p for p in (folder, *folder.parents) if not p.exists()]  # deepest first
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise VeilError(f"cannot create run folder '{folder}': {e.strerror}") from None
    if not folder.is_dir():
        raise VeilError(f"'{folder}' is a file, not a run folder")
    if not created:
        check_ours(folder)
    fd = _acquire(folder / LOCK_NAME, folder)
    try:
        yield folder
    finally:
        _release(fd, folder / LOCK_NAME, created)


def check_ours(folder: Path) -> None:
    """A one-line `VeilError` when an existing `folder` holds files (hidden ones aside) and nothing
    a veil command writes: a user's own folder, which a run must not write among."""
    try:
        names = sorted(p.name for p in folder.iterdir() if not p.name.startswith("."))
    except OSError as e:
        raise VeilError(f"cannot read run folder '{folder}': {e.strerror}") from None
    if names and not set(names) & OURS:
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        raise VeilError(
            f"'{folder}' is not a veil run folder (it holds {shown}); pick a new or empty --out, so nothing of yours is written among"
        )


def _acquire(path: Path, folder: Path) -> int:
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise VeilError(f"cannot write in run folder '{folder}' ({e.strerror}); pick another --out") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise VeilError(
                f"run folder '{folder}' is in use by another veil process (pid {pid}); "
                "wait for it to finish, or pick another --out"
            ) from None
        try:  # the holder we waited on may have removed the file: lock the one that is there now
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
            return fd
        os.close(fd)


def _release(fd: int, path: Path, created: list[Path]) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()  # before unlocking: a process that opened it meanwhile sees the inode change
    os.close(fd)
    for folder in created:  # the folders this lock made, while they are empty
        try:
            folder.rmdir()
        except OSError:
            break


def holds_progress(folder: str | Path) -> bool:
    """Whether `folder` holds any file besides a lock and the configs a run writes before its first step."""
    folder = Path(folder)
    if not folder.is_dir():
        return False
    return any(p.is_file() and p.name not in NOT_PROGRESS and not p.name.endswith(".tmp") for p in folder.rglob("*"))
