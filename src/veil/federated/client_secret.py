"""Client-held secrets: the entropy a client mixes into the randomness that protects it.

A defense's noise (AEGIS, DP-SGD, Gaussian), MJP's shuffles and p-FeSTA's permutation keys are
drawn from seeded generators, so that a run can be repeated. But the server sends every client
the run spec, seed included, and knows each client's id and round: from those alone it could
regenerate a client's noise and subtract it, or re-derive its permutation keys and undo them.
So each client mixes in a secret the server never sees (`secret` in the `federated:` and
`split:` sections):

  random   (default) 256 bits from the operating system's CSPRNG (`secrets`), drawn once per
           client process and kept in this module only — never in a message, a spec, a run
           folder or a server-side object. Each (round, client) gets its own secret derived from
           it, so noise never repeats across rounds or clients either. A rerun draws new noise.
  seeded   derived from (train.seed, round, client): exactly reproducible (`--resume` ends on the
           weights of an uninterrupted run; a test can recompute a client's update), and exactly
           as predictable to the server, which knows the seed. For experiments, not deployments.

In split learning only the permutation keys need the secret; in `seeded` mode they follow the
seed as before (keys are fresh per call either way).
"""

from __future__ import annotations

import secrets

import numpy as np

MODES = ("random", "seeded")

_process_secret: int | None = None


def process_secret() -> int:
    """This client process's 256-bit secret, drawn from the OS on first use."""
    global _process_secret
    if _process_secret is None:
        _process_secret = secrets.randbits(256)
    return _process_secret


def derive(root: int, *path: int) -> int:
    """A 128-bit secret derived from `root` along `path` (independent for every path)."""
    words = np.random.SeedSequence(root, spawn_key=tuple(int(p) % 2**32 for p in path)).generate_state(4, np.uint32)
    return int.from_bytes(words.astype("<u4").tobytes(), "little")


def round_secret(mode: str, seed: int, rnd: int, pid: int) -> int:
    """The secret of client `pid` in round `rnd` (see the module docstring for the modes)."""
    return derive(process_secret() if mode == "random" else int(seed) % 2**64, rnd, pid)


def client_secret(pid: int) -> int:
    """Client `pid`'s secret for keys that are not per round (split learning's permutations)."""
    return derive(process_secret(), pid)
