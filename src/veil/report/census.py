"""The report's census block: what the server sees of each defense's update, tensor by tensor
(summary ``tasks[t].census``, `veil.experiments.census`). Tensors whose names differ only in
their block number and share a state under every defense are one row (``blocks.*.mlp.fc2.weight``);
a noised tensor shows its noise-to-signal ratio (the range over the row's tensors); a clean one
the attacks that read it in closed form, or "read by no attack" where none does.
"""

from __future__ import annotations

import re
from typing import Any

Block = tuple


def _cell(entries: list[dict[str, Any]]) -> str:
    state = entries[0]["state"]
    if state == "noised":
        lo, hi = min(e["nsr"] for e in entries), max(e["nsr"] for e in entries)
        return f"noised, NSR {lo:.3g}" + (f"-{hi:.3g}" if hi > lo * 1.005 else "")
    if state == "clean":
        readers = sorted({a for e in entries for a in e.get("read_by", [])})
        return "clean, read by " + ", ".join(f"`{a}`" for a in readers) if readers else "**clean, read by no attack**"
    return state


def census_rows(census: dict[str, dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """(defenses, rows [tensor pattern, role, one cell per defense])."""
    defenses = list(census)
    names = list(next(iter(census.values()))["tensors"]) if census else []
    groups: dict[tuple[str, tuple[str, ...]], list[str]] = {}
    for n in names:
        states = tuple(census[d]["tensors"].get(n, {}).get("state", "—") for d in defenses)
        groups.setdefault((re.sub(r"\.\d+\.", ".*.", n), states), []).append(n)
    rows = []
    for (pattern, _), members in groups.items():
        first = census[defenses[0]]["tensors"][members[0]]
        cells = [_cell([census[d]["tensors"][m] for m in members if m in census[d]["tensors"]]) for d in defenses]
        rows.append(
            [f"`{pattern}`" + (f" ({len(members)})" if len(members) > 1 else ""), first.get("role", ""), *cells]
        )
    return defenses, rows


def census_blocks(t: dict[str, Any]) -> list[Block]:
    """The census table of one task, with the counts per defense; nothing without a census."""
    census = t.get("census") or {}
    if not census:
        return []
    defenses, rows = census_rows(census)
    counts = "; ".join(
        f"`{d}`: " + ", ".join(f"{c['counts'][k]} {k}" for k in ("clean", "noised", "frozen", "absent"))
        for d, c in census.items()
    )
    return [
        ("h3", "What the server sees (census of the exported update)"),
        (
            "p",
            "Every parameter of one defended client step: clean (exported as computed), noised (NSR = "
            "||exported - clean|| / ||clean||), frozen (not trained, nothing exported) or absent (no gradient). "
            f"A clean tensor lists the attacks of this audit that read it in closed form. Tensors: {counts}.",
        ),
        ("table", ["tensor", "role", *defenses], rows),
    ]
