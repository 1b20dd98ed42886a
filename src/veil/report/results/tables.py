"""The generic pieces the results sections share: one number format and one Markdown table."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def fmt(v: Any, digits: int = 3) -> str:
    """A table cell: "—" for a missing value, a number to `digits` decimals, anything else as text."""
    if v is None:
        return "—"
    return f"{v:.{digits}f}" if isinstance(v, (int, float)) and not isinstance(v, bool) else str(v)


def count(v: Any, missing: str = "?") -> str:
    """A count with thousands separators; `missing` for anything that is not an int."""
    return f"{v:,}" if isinstance(v, int) and not isinstance(v, bool) else missing


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table; cells are written as given (format them with `fmt` first)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def mean_std(values: Sequence[float], scale: float = 1.0, digits: int = 2) -> str:
    """'m ± sd' of `values` (population std, as the MJP tables print it) times `scale`."""
    m = sum(values) / len(values)
    sd = (sum((v - m) ** 2 for v in values) / len(values)) ** 0.5
    return f"{scale * m:.{digits}f} ± {scale * sd:.{digits}f}"


def entry_label(entry: dict[str, Any] | str) -> str:
    """A scenario entry's label as the audit keys it: mjp, mjp(gamma=0.1) (options sorted)."""
    if isinstance(entry, str):
        return entry
    extra = ",".join(f"{k}={v}" for k, v in sorted(entry.items()) if k != "name")
    return f"{entry['name']}({extra})" if extra else entry["name"]


def raw_tasks(summary: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The scenario's own task entries (summary['config']), by task name."""
    return {t["name"]: t for t in summary.get("config", {}).get("tasks", [])}
