"""The generic pieces the results sections share: one number format, one Markdown table, the
"within N points of the baseline" cells, and the walk over a summary's tasks in the scenario's order."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from statistics import mean
from typing import Any

#: float slack on a "within N points" goal (points)
SLACK = 1e-9


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


def scenario_tasks(summary: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any], dict[str, Any], list[str]]]:
    """Every task of the summary as (name, its summary entry, its scenario entry ({} when the
    summary carries no config), its defense labels in the scenario's order, else the summary's)."""
    raw = raw_tasks(summary)
    for name, t in summary["tasks"].items():
        entry = raw.get(name, {})
        yield name, t, entry, [entry_label(d) for d in entry.get("defenses", [])] or list(t["utility"])


def config_values(summary: dict[str, Any], *path: str, missing: str = "?") -> str:
    """The setting at `path` of every task's scenario entry (`missing` where it has none), each
    value once, sorted as text and joined by '/': a note's "{epochs} epochs"."""
    raw = raw_tasks(summary)
    values = set()
    for name in summary["tasks"]:
        node = raw.get(name, {})
        for key in path[:-1]:
            node = node.get(key, {})
        values.add(node.get(path[-1], missing))
    return "/".join(str(v) for v in sorted(values, key=str))


def within_points(values: Sequence[float], base: Sequence[float], points: float) -> list[str]:
    """The cells of a "within `points` of the baseline" goal: mean(values) - mean(base) in points
    (accuracies are fractions; signed, 2 decimals) and "yes" where it is at least -`points`, else "**no**".
    The comparison allows float slack: 6 of 600 items is exactly 1 point, which division puts a hair below."""
    gap = 100 * (mean(values) - mean(base))
    return [f"{gap:+.2f}", "yes" if gap >= -points - SLACK else "**no**"]
