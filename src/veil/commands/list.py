"""`veil list [--details NAME]`: the registered models, data sets, defenses and attacks; with
`--details NAME`, a component's options with their types, defaults and help.

Read from a catalog of the builders' signatures (`veil.commands.catalog`), so it does not import
torch while the catalog matches the installed sources.
"""

from __future__ import annotations

import argparse
from typing import Any

from veil.commands.catalog import KINDS, load
from veil.errors import VeilError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "list", help="list models, data sets, defenses and attacks (--details NAME: its options)", description=__doc__
    )
    p.add_argument(
        "--details", metavar="NAME", default=None, help="print the options of component NAME (type, default, help)"
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    kinds = load()["kinds"]
    if args.details:
        print(details(kinds, args.details))
        return 0
    for title in KINDS:
        print(f"{title}:")
        for name, entry in kinds[title].items():
            print(f"  {name:<20} {entry['help']}")
    return 0


def details(kinds: dict[str, Any], name: str) -> str:
    """Every component called `name` (a name may be, say, both a data set and a model) with its options."""
    found = [
        (kind[:-1] if kind != "data sets" else "data set", kinds[kind][name]) for kind in kinds if name in kinds[kind]
    ]
    if not found:
        raise VeilError(f"unknown component {name!r}; `veil list` shows the names")
    blocks = []
    for kind, entry in found:
        lines = [f"{kind} {name}: {entry['help']}"]
        rows = entry["options"]
        if rows is None:
            lines.append("  options: none declared (the attack reads its settings itself; see its module's docstring)")
        elif not rows:
            lines.append("  options: none")
        else:
            w = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(("option", "type", "default"))]
            lines.append(f"  {'option':<{w[0]}}  {'type':<{w[1]}}  {'default':<{w[2]}}  help")
            lines += [f"  {r[0]:<{w[0]}}  {r[1]:<{w[1]}}  {r[2]:<{w[2]}}  {r[3]}".rstrip() for r in rows]
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)
