"""How many CPU threads a run can actually have.

torch starts one thread per core. On a machine that other work is using, those threads wait on
each other at every parallel region, and a small model slows down many times over. ``threads: 0``
(the default) therefore means "what the machine can give now": the cores this process may run on
minus the load other processes put on them (the one-minute load average), at least one, unless
the environment says otherwise (``OMP_NUM_THREADS``, the usual way to pin a job's threads).

The count is part of a run's numbers (a sum split over more threads rounds differently), so a
training run records the count it chose in its checkpoint and a resumed run keeps it.
"""

from __future__ import annotations

import os

import torch


def usable_cores() -> int:
    """The cores this process may be scheduled on (its affinity mask, else every core)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def free_cores(load: float | None = None) -> int:
    """Usable cores minus the rounded one-minute load average (`load`, read when None), at least 1."""
    if load is None:
        try:
            load = os.getloadavg()[0]
        except OSError:
            load = 0.0
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
