"""Seeded standard-normal noise for large gradient tables, fast on a CPU (timings: docs/results.md,
AEGIS section).

A defense that noises a vocabulary-sized gradient table (AEGIS eq. (E): 30,522 x D entries every
step) spends most of its time making Gaussian numbers. torch's CPU ``normal_`` draws them one by
one from a single Mersenne-Twister stream, on any thread count.

The draw:

1. the random bits come from numpy's SFC64 (a small chaotic generator that passes PractRand and
   BigCrush; 64 bits per call, faster than torch's CPU generator), one stream per call seeded from
   the call's key through ``numpy.random.SeedSequence``;
2. Box-Muller turns them into Gaussians, the same transform torch's own ``normal_`` applies:

       u1 = (k1 + 1/2) / 2^23          k1 = the top 23 bits of word i        (u1 in (0, 1))
       t  = 2 pi w2 / 2^32             w2 = word m + i as a signed integer   (t in [-pi, pi])
       z_i = sqrt(-2 ln u1) sin t,     z_{m+i} = sqrt(-2 ln u1) cos t,       i < m = ceil(n / 2)

   (z_i, z_{m+i}) are two independent N(0, 1) draws; a 23-bit u1 bounds |z| by 5.77, as
   torch's 24-bit uniform does.

Where the transform runs (`noise_tables_`, which also takes each table's noise scale from its
clean values and adds the noise in place):

* compiled (the default on a CPU): the scales, the transform and the adds are one torch.compile
  graph — one pass over the tables, in registers, split over torch's OpenMP threads; the bits
  stay serial. The first call in a process compiles (torch's on-disk cache keeps the graph);
* numpy (no working C++ compiler, or ``VEIL_COMPILE=0``): the transform in numpy's float32
  ufuncs (vectorised log / sin / cos, faster than torch's eager ones on one core), then torch
  adds the noise. Serial: splitting it over Python threads gained nothing inside a
  training step.

Both paths take the same bits; their values differ only by the float32 rounding of log / sin /
cos (below 1e-5 of the noise's std), and neither depends on the thread count: the same key gives
the same noise, a new key fresh noise (the last bit may differ between CPUs that pick another
SIMD path). On a GPU the noise comes from ``torch.randn`` on a generator seeded from the same key.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any

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
    return np.random.SeedSequence(int(secret) % 2**256, spawn_key=tuple(key_words(key)))


def torch_seed(key: Sequence[int], secret: int | None = None) -> int:
    """A ``torch.manual_seed`` value (63 bits) drawn from the key's (and secret's) SeedSequence."""
    return int(seed_sequence(key, secret).generate_state(1, np.uint64)[0]) & 0x7FFF_FFFF_FFFF_FFFF


def sfc64_words(n: int, key: Sequence[int], secret: int | None = None) -> np.ndarray:
    """The bits of n draws: ceil(n / 2) SFC64 words seeded from the key (and secret), as 2 ceil(n / 2) int32."""
    return np.random.SFC64(seed_sequence(key, secret)).random_raw((n + 1) // 2).view(np.int32)


def standard_normal(
    n: int, key: Sequence[int], device: torch.device | str = "cpu", out: Tensor | None = None, secret: int | None = None
) -> Tensor:
    """n i.i.d. N(0, 1) float32 values, a deterministic function of ``key`` (a tuple of integers)
    and ``secret`` (see `seed_sequence`), by the transform above in numpy.

    ``out`` (a float32 tensor on ``device`` with at least n + 1 entries) is reused as the work
    space — pass the tensor returned by the previous call to avoid reallocating it."""
    device = torch.device(device)
    if device.type != "cpu":
        g = torch.Generator(device=device)
        g.manual_seed(torch_seed(key, secret))
        return torch.randn(n, generator=g, device=device)
    m = (n + 1) // 2
    if (
        out is None
        or out.numel() < 2 * m
        or out.dtype != torch.float32
        or out.device != device
        or not out.is_contiguous()
    ):
        out = torch.empty(2 * m, dtype=torch.float32)
    bits = sfc64_words(n, key, secret)
    space = out.detach().numpy()
    radius, angle = space[:m], space[m : 2 * m]
    np.right_shift(bits[:m], 9, out=bits[:m])
    radius[:] = bits[:m]
    radius += 2.0**22 + 0.5
    radius *= 2.0**-23
    np.log(radius, out=radius)
    radius *= -2.0
    np.sqrt(radius, out=radius)
    angle[:] = bits[m:]
    angle *= 2 * math.pi * 2.0**-32
    sin = np.sin(angle)
    np.cos(angle, out=angle)
    angle *= radius
    radius *= sin
    return out[:n]


#: a table's statistic that its noise std is proportional to (e.g. its largest row norm)
Statistic = Callable[[Tensor], Tensor]


def noise_tables_(
    tables: Sequence[Tensor],
    stats: Sequence[Statistic],
    factors: Sequence[float],
    key: Sequence[int],
    secret: int | None = None,
    work: dict[str, Tensor] | None = None,
) -> list[float]:
    """Noise each table in place with a std taken from its CLEAN values: s_j = factors[j] *
    stats[j](T_j), then T_j += s_j z_j, where z (n = the tables' total size) is the key's draw
    laid over the tables in order. Returns the s_j.

    On a CPU the statistics, the transform and the adds are one compiled graph (`_noise_graph`)
    when torch.compile works here; otherwise (no C++ compiler, or ``VEIL_COMPILE=0``) numpy draws
    z (`standard_normal`) and torch adds it. Both take the same bits, so they agree up to float32
    rounding of log / sin / cos. ``work``: a dict the caller keeps across calls, where the numpy
    path keeps its work space."""
    tables = list(tables)
    if not tables:
        return []
    device, n = tables[0].device, sum(t.numel() for t in tables)
    scale = torch.tensor(list(factors), dtype=torch.float32, device=device)
    graph = _compiled_graph() if device.type == "cpu" else None
    if graph is not None:
        from torch._dynamo.exc import BackendCompilerFailed  # dynamo loads only here (its import is slow)

        try:
            return graph(torch.from_numpy(sfc64_words(n, key, secret)), tables, tuple(stats), scale).tolist()
        except BackendCompilerFailed as e:  # raised before the graph runs: no table was touched
            _give_up_compiling(e)
    stds = _stds(tables, stats, scale).tolist()
    work = {} if work is None else work
    if device.type == "cpu" and ("z" not in work or work["z"].numel() < n + 1):  # a GPU draw needs no work space
        work["z"] = torch.empty(n + 1, dtype=torch.float32)
    z = standard_normal(n, key, device, out=work.get("z"), secret=secret)
    offset = 0
    for t, std in zip(tables, stds):
        t.add_(z[offset : offset + t.numel()].view_as(t), alpha=std)
        offset += t.numel()
    return stds


def _stds(tables: list[Tensor], stats: Sequence[Statistic], scale: Tensor) -> Tensor:
    """s_j = scale_j * stats[j](T_j), from the clean tables."""
    return torch.stack([f(t) for f, t in zip(stats, tables)]) * scale


def _noise_graph(bits: Tensor, tables: list[Tensor], stats: tuple[Statistic, ...], scale: Tensor) -> Tensor:
    """`noise_tables_` as one graph for torch.compile: the transform above on ``bits`` (2m
    int32), fused with the statistics and the in-place adds, on every thread of torch's pool."""
    stds = _stds(tables, stats, scale)
    m = bits.shape[0] // 2
    radius = torch.sqrt(-2.0 * torch.log(((bits[:m] >> 9).float() + (2.0**22 + 0.5)) * 2.0**-23))
    angle = bits[m:].float() * (2 * math.pi * 2.0**-32)
    z = torch.cat([radius * torch.sin(angle), radius * torch.cos(angle)])
    offset = 0
    for j, t in enumerate(tables):
        t.add_(z[offset : offset + t.numel()].view_as(t) * stds[j])
        offset += t.numel()
    return stds


_GRAPH: dict[str, Any] = {}
#: table sets one process may compile the noise graph for before dynamo would fall back to eager
RECOMPILE_LIMIT = 256


def _compiled_graph() -> Callable[..., Tensor] | None:
    """`_noise_graph` compiled once per process (shapes dynamic), or None where compiling is off.

    Each set of tables (their count and statistics) is one more specialisation of the graph; past
    dynamo's recompile limit (8) it would run the graph eagerly, whose reductions (the clean
    statistics) round differently with the thread count. An audit meets many such sets in one
    process (every defense x model), so the limit is raised to keep every draw compiled."""
    if "fn" not in _GRAPH:
        off = os.environ.get("VEIL_COMPILE", "1").strip().lower() in ("0", "false", "no", "off")
        if not off:
            import torch._dynamo.config as dynamo_config

            dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, RECOMPILE_LIMIT)
        _GRAPH["fn"] = None if off else torch.compile(_noise_graph, dynamic=True)
    return _GRAPH["fn"]


def _give_up_compiling(error: Exception) -> None:
    _GRAPH["fn"] = None
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    warnings.warn(
        f"torch.compile failed ({first}); AEGIS noise falls back to numpy, ~1.3x slower on a CPU. "
        "Set VEIL_COMPILE=0 to skip the attempt.",
        RuntimeWarning,
        stacklevel=3,
    )


def keyed_generator(
    seed: int, step: int, count: int, device: torch.device, secret: int | None = None
) -> torch.Generator:
    """A generator whose state depends on (seed, step, count) and the secret only: reproducible, never repeated."""
    g = torch.Generator(device=device)
    g.manual_seed(torch_seed((seed, step, count), secret))
    return g
