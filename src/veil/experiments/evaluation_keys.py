"""The keys a scenario task's `evaluate:` mapping takes, checked without loading torch, so a bad
scenario is refused before the heavy packages load (`veil.experiments.evaluations` runs them)."""

from __future__ import annotations

from typing import Any

from veil.errors import VeilError

EVALUATIONS = ("test_shuffle", "pe", "membership")


def check_evaluations(raw: Any, where: str) -> dict[str, Any]:
    """A task's `evaluate:` mapping, validated (one line if bad)."""
    if not isinstance(raw, dict) or set(raw) - set(EVALUATIONS):
        bad = sorted(set(raw) - set(EVALUATIONS)) if isinstance(raw, dict) else raw
        raise VeilError(f"{where}.evaluate: unknown {bad!r}; allowed: {', '.join(EVALUATIONS)}")
    gammas = raw.get("test_shuffle", [])
    if not isinstance(gammas, list) or not all(isinstance(g, (int, float)) and 0 <= g <= 1 for g in gammas):
        raise VeilError(f"{where}.evaluate.test_shuffle must be a list of ratios in [0, 1], got {gammas!r}")
    dims = raw.get("pe", 0)
    if not isinstance(dims, int) or isinstance(dims, bool) or dims < 0:
        raise VeilError(f"{where}.evaluate.pe must be a number of PCA dimensions >= 1, got {dims!r}")
    if not isinstance(raw.get("membership", False), bool):
        raise VeilError(f"{where}.evaluate.membership must be true or false, got {raw['membership']!r}")
    return dict(raw)
