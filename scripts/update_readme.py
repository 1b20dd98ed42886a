"""Paste measured numbers from an audit folder into README.md (never typed by hand).

    python scripts/update_readme.py runs/audit

Fills the blocks between <!-- quickstart:start/end --> (the quickstart report's tables) and
<!-- headline:start/end --> (one line per task: accuracy and the worst-case leakage per defense).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from veil.metrics.leakage import describe
from veil.report.render import summary_blocks, to_markdown

ROOT = Path(__file__).resolve().parent.parent
#: the census block (every tensor, per defense) stays in report.md: too long for the README
CENSUS = "What the server sees (census of the exported update)"


def replace_block(text: str, name: str, body: str) -> str:
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{start}\n{body.strip()}\n{end}{tail}"


def quickstart_tables(summary: dict, out: Path) -> str:
    keep, census = [], False
    for block in summary_blocks(summary, out):
        if block[0] == "h2" and block[1] == "Software":
            break
        if block[0] in ("h2", "h3"):
            census = block[1] == CENSUS  # the census and its table are skipped
        if census or (block[0] == "h3" and block[1] == "What the server rebuilt"):
            continue
        if block[0] in ("h3", "table") or (block[0] == "h2" and block[1].startswith("Task")):
            keep.append(("h4", block[1]) if block[0] in ("h2", "h3") else block)
    md = to_markdown([("p", f"**{b[1]}**") if b[0] == "h4" else b for b in keep], out)
    return (
        md
        + f"\n*Measured by `veil audit` on this machine ({summary['versions']['platform']}); regenerate with `python scripts/update_readme.py {out}`.*"
    )


def headline(summary: dict) -> str:
    """One line per task: per defense, the accuracy and the worst case (the attack that rebuilt the most)."""
    lines = [
        "Headline numbers of the quickstart audit (one seed, small models, CPU); leakage is the worst case "
        "over the attacks that ran (`worst_case` in summary.json):",
        "",
    ]
    for name, t in summary["tasks"].items():
        parts = []
        for d, u in t["utility"].items():
            wc = t.get("worst_case", {}).get(d)
            leak = f"; worst case {describe(wc, 3, ('token_recovery', 'psnr'))}" if wc else ""
            parts.append(f"**{d}**: accuracy {u['test_accuracy_mean']:.3f}{leak}")
        lines.append(f"- `{name}` ({t['model']} on {t['data']}) — " + " · ".join(parts))
    return "\n".join(lines)


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/audit")
    summary = json.loads((out / "summary.json").read_text())
    readme = ROOT / "README.md"
    text = readme.read_text()
    text = replace_block(text, "quickstart", quickstart_tables(summary, out))
    text = replace_block(text, "headline", headline(summary))
    readme.write_text(text)
    print(f"README.md updated from {out}/summary.json")


if __name__ == "__main__":
    main()
