"""Seeded standard-normal noise for large gradient tables, fast on a CPU.

A defense that noises a vocabulary-sized gradient table (AEGIS eq. (E): 30,522 x D entries every
step) spends most of its time making Gaussian numbers. torch's CPU ``normal_`` draws them one by
one from a single Mersenne-Twister stream (10.0 ms for 30,522 x 96 here), and drawing chunks on
Python threads helps little inside a training step: after every parallel op, OpenMP's idle
worker spins for ~10 ms on the second core (measured: 9.0 ms on two threads right after a
matmul, 6.0 ms when idle).

So the work is split by what each part is good at:

1. the random bits come from numpy's SFC64 (a small chaotic generator that passes PractRand and
   BigCrush; 64 bits per call, ~3x torch's CPU generator here), one stream per call seeded from
   the call's key through ``numpy.random.SeedSequence``;
2. Box-Muller turns them into Gaussians with numpy's float32 ufuncs, in place in the caller's
   work space — the same transform torch's own ``normal_`` applies:

       u1 = (k1 + 1/2) / 2^23          k1 = the top 23 bits of word i        (u1 in (0, 1))
       t  = 2 pi w2 / 2^32             w2 = word m + i as a signed integer   (t in [-pi, pi])
       z_i = sqrt(-2 ln u1) sin t,     z_{m+i} = sqrt(-2 ln u1) cos t,       i < m = ceil(n / 2)

   (z_i, z_{m+i}) are two independent N(0, 1) draws; a 23-bit u1 bounds |z| by 5.77, as
   torch's 24-bit uniform does.

Why numpy for the transform: its AVX-512 float32 log / sin / cos are 2.5-2.9x faster than
torch's on one core here (1.54 M values: log 0.57 vs 1.66 ms, sin 0.79 vs 1.93 ms, cos 0.81 vs
2.07 ms). The draw for transformer4's tables (30,522 x 96 + its MLP-up tables, 3.1 M values)
takes 7.7 ms on one core against 11.7 ms with the same transform in torch ops and 11.3 ms for
``normal_``. On two cores torch's transform runs in parallel and the two are level (8.0 ms);
splitting numpy's transform over Python threads gained nothing inside a step (the spinning
OpenMP worker above). numpy runs the transform on one thread, so the values depend only on the
key, not on the thread count: the same key gives the same noise, a new key fresh noise (the last
bit of log / sin / cos may differ between CPUs whose numpy picks another SIMD path). On a GPU the
noise comes from ``torch.randn`` on a generator seeded from the same key.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch
from torch import Tensor


def key_words(key: Sequence[int]) -> list[int]:
    """The key as 32-bit words (each integer of the key taken modulo 2^32)."""
    return [int(k) & 0xFFFFFFFF for k in key]


def seed_sequence(key: Sequence[int], secret: int | None = None) -> np.random.SeedSequence:
    """The key's SeedSequence; with a ``secret`` (client-held entropy of any size) the key becomes
    its spawn key, so the stream is unpredictable to anyone who knows the key but not the secret."""
    if secret is None:
        return np.random.SeedSequence(key_words(key))
    return np.random.SeedSequence(int(secret) % 2 ** 256, spawn_key=tuple(key_words(key)))


def torch_seed(key: Sequence[int], secret: int | None = None) -> int:
    """A ``torch.manual_seed`` value (63 bits) drawn from the key's (and secret's) SeedSequence."""
    return int(seed_sequence(key, secret).generate_state(1, np.uint64)[0]) & 0x7FFF_FFFF_FFFF_FFFF


def standard_normal(n: int, key: Sequence[int], device: torch.device | str = "cpu", out: Tensor | None = None,
                    secret: int | None = None) -> Tensor:
    """n i.i.d. N(0, 1) float32 values, a deterministic function of ``key`` (a tuple of integers)
    and ``secret`` (see `seed_sequence`).

    ``out`` (a float32 tensor on ``device`` with at least n + 1 entries) is reused as the work
    space — pass the tensor returned by the previous call to avoid reallocating it."""
    device = torch.device(device)
    if device.type != "cpu":
        g = torch.Generator(device=device)
        g.manual_seed(torch_seed(key, secret))
        return torch.randn(n, generator=g, device=device)
    m = (n + 1) // 2
    if out is None or out.numel() < 2 * m or out.dtype != torch.float32 or out.device != device or not out.is_contiguous():
        out = torch.empty(2 * m, dtype=torch.float32)
    bits = np.random.SFC64(seed_sequence(key, secret)).random_raw(m).view(np.int32)  # 2m x 32 bits
    space = out.detach().numpy()
    radius, angle = space[:m], space[m:2 * m]
    np.right_shift(bits[:m], 9, out=bits[:m])
    radius[:] = bits[:m]
    radius += 2.0 ** 22 + 0.5
    radius *= 2.0 ** -23
    np.log(radius, out=radius)
    radius *= -2.0
    np.sqrt(radius, out=radius)
    angle[:] = bits[m:]
    angle *= 2 * math.pi * 2.0 ** -32
    sin = np.sin(angle)
    np.cos(angle, out=angle)
    angle *= radius
    radius *= sin
    return out[:n]


def keyed_generator(seed: int, step: int, count: int, device: torch.device, secret: int | None = None) -> torch.Generator:
    """A generator whose state depends on (seed, step, count) and the secret only: reproducible, never repeated."""
    g = torch.Generator(device=device)
    g.manual_seed(torch_seed((seed, step, count), secret))
    return g
