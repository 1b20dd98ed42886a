"""How many CPU threads a run can actually have.

torch starts one thread per core. On a machine that other work is using, those threads wait on
each other at every parallel region, and a small model slows down many times over. ``threads: 0``
(the default) therefore means "what the machine can give now": the cores this process may run on
minus the load other processes put on them, at least one, unless the environment says otherwise
(``OMP_NUM_THREADS``, the usual way to pin a job's threads). The load is read *now*: the CPU time
other processes used over a short window (Linux ``/proc/stat``, less this process's own time),
not the one-minute load average, which still counts a job that ended a minute ago and misses one
that started a second ago. Elsewhere the load average stands in.

The count is part of a run's numbers (a sum split over more threads rounds differently), so a
training run records the count it chose in its checkpoint and a resumed run keeps it.
"""

from __future__ import annotations

import os
import time

import torch


def usable_cores() -> int:
    """The cores this process may be scheduled on (its affinity mask, else every core)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _cpu_jiffies() -> tuple[int, int]:
    """(busy, total) CPU time of the whole machine so far, in clock ticks (``/proc/stat``)."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
    return sum(ticks[:8]) - idle, sum(ticks[:8])


def _own_seconds() -> float:
    t = os.times()
    return t.user + t.system


def current_load(window: float = 0.25) -> float:
    """Cores' worth of CPU that other processes are using now: the machine's busy time over
    `window` seconds less this process's own, as a count of cores; the one-minute load average
    where ``/proc/stat`` is missing."""
    try:
        (b0, t0), own0, w0 = _cpu_jiffies(), _own_seconds(), time.monotonic()
        time.sleep(window)
        (b1, t1), own1, w1 = _cpu_jiffies(), _own_seconds(), time.monotonic()
    except (OSError, ValueError, IndexError):
        try:
            return os.getloadavg()[0]
        except OSError:
            return 0.0
    cores = os.cpu_count() or 1
    busy = cores * (b1 - b0) / max(t1 - t0, 1)
    return max(0.0, busy - (own1 - own0) / max(w1 - w0, 1e-6))


def free_cores(load: float | None = None) -> int:
    """Usable cores minus the rounded load of other processes (`load`, `current_load()` when None), at least 1."""
    if load is None:
        load = current_load()
    return max(1, usable_cores() - int(load + 0.5))


def resolve_threads(setting: int) -> int:
    """`setting` when > 0, else ``OMP_NUM_THREADS`` when set, else what the machine can give now."""
    if setting > 0:
        return setting
    env = os.environ.get("OMP_NUM_THREADS", "")
    return int(env) if env.isdigit() and int(env) > 0 else free_cores()


def use_threads(setting: int) -> int:
    """Set torch's intra-op threads from a ``threads`` setting; returns the count chosen."""
    n = resolve_threads(setting)
    torch.set_num_threads(n)
    return n
