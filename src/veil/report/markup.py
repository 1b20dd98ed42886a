"""The report's blocks as Markdown and as one self-contained HTML page (PNGs embedded).

Blocks: ("h1" | "h2" | "h3", text), ("p", text), ("pre", text), ("table", header, rows),
("img", path, caption), ("tokens", title, [(reference, [(token, right)])]) and
("glance", title, [[defense, cost, leakage, verdict, says]]) (veil.report.headline).

The page is laid out to be read at a glance and checked in a headless browser
(tests/test_report_browser.py): nothing is clipped or overlaps at a laptop's width. Long
unbroken labels (`ig(iterations=150,restarts=1)`, `psnr_unshuffled`) get break points after
commas, underscores and `=`, and may break inside a word as a last resort; numbers stay on one line; pre-formatted text wraps;
figures are shown at their natural size (they are drawn at most ~1000 px wide).
"""

from __future__ import annotations

import base64
import html
import re
from pathlib import Path

from veil.report.figures import COLOURS

CSS = (
    "body{font-family:system-ui,sans-serif;max-width:1180px;margin:2em auto;padding:0 1em;color:#222;line-height:1.4}",
    "table{border-collapse:collapse;margin:.5em 0 1.2em}",
    "td,th{border:1px solid #ccc;padding:3px 7px;font-size:13px;text-align:left;overflow-wrap:break-word;vertical-align:top}",
    "th{background:#f3f3f3}td.num{text-align:right;white-space:nowrap}",
    ".bad{color:#b00;text-decoration:line-through}code{font-size:92%;background:#f3f3f3;padding:0 .2em}",
    "pre{background:#f6f6f6;padding:1em;font-size:12px;white-space:pre-wrap;overflow-wrap:anywhere}",
    "p,li,figcaption,h1,h2,h3{overflow-wrap:break-word}",
    "figure{margin:1em 0}figure img{display:block}figcaption{font-size:12px;color:#555;max-width:960px}",
    "ul.glance{list-style:none;padding-left:0;margin:.3em 0 1em}ul.glance li{margin:.25em 0;padding-left:.6em}",
    ".verdict{display:inline-block;min-width:4.5em;text-align:center;color:#fff;border-radius:3px;"
    "padding:0 .4em;margin-right:.4em;font-weight:600;font-size:13px}",
    *(f"li.{v}{{border-left:5px solid {c}}}.verdict.{v}{{background:{c}}}" for v, c in COLOURS.items()),
)


def to_markdown(blocks: list[tuple], out: Path) -> str:
    """report.md: headings, paragraphs, tables, figures by relative path, token alignments."""
    lines: list[str] = []
    for b in blocks:
        kind = b[0]
        if kind in ("h1", "h2", "h3"):
            lines += ["#" * int(kind[1]) + " " + b[1], ""]
        elif kind == "p":
            lines += [b[1], ""]
        elif kind == "pre":
            lines += ["```yaml", b[1].rstrip(), "```", ""]
        elif kind == "table":
            lines += ["| " + " | ".join(b[1]) + " |", "|" + "---|" * len(b[1])]
            lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in b[2]] + [""]
        elif kind == "img":
            lines += [f"![{b[2]}]({Path(b[1]).relative_to(out)})", "", f"*{b[2]}*", ""]
        elif kind == "tokens":
            lines += [f"**{b[1]}** (wrong tokens struck through)", ""]
            for ref, toks in b[2]:
                lines += [f"- true: {ref}", "  rebuilt: " + " ".join(t if ok else f"~~{t}~~" for t, ok in toks)]
            lines.append("")
        elif kind == "glance":
            lines += [f"**{b[1]}**", ""]
            lines += [
                f"- **{v.upper()}** `{d}` — {cost}; worst case {leak} — {says}" for d, cost, leak, v, says in b[2]
            ]
            lines.append("")
    return "\n".join(lines)


def inline(text: str) -> str:
    """Escaped text with `code` spans and break points after , _ = in long words."""
    out = html.escape(text)
    out = re.sub(r"([,_=])(?=\S)", r"\1<wbr>", out)
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", out)


NUMBER = re.compile(r"^(—|-?inf|[-+]?\d[\d.]*(e[-+]?\d+)?( ± [\d.]+)?)$")


def cell(value: object) -> str:
    """A table cell: numbers (and the dash of a missing one) right-aligned on one line, text left."""
    text = str(value)
    return f"<td class='num'>{html.escape(text)}</td>" if NUMBER.match(text) else f"<td>{inline(text)}</td>"


def to_html(blocks: list[tuple]) -> str:
    """report.html: one page, its CSS inline and its figures embedded as data URIs."""
    e = html.escape
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        "<meta name='viewport' content='width=device-width, initial-scale=1'><title>veil audit</title><style>",
        *CSS,
        "</style></head><body>",
    ]
    for b in blocks:
        kind = b[0]
        if kind in ("h1", "h2", "h3"):
            parts.append(f"<{kind}>{inline(b[1])}</{kind}>")
        elif kind == "p":
            parts.append(f"<p>{inline(b[1])}</p>")
        elif kind == "pre":
            parts.append(f"<pre>{e(b[1])}</pre>")
        elif kind == "table":
            head = "".join(f"<th>{inline(str(h))}</th>" for h in b[1])
            body = "".join("<tr>" + "".join(cell(c) for c in row) + "</tr>" for row in b[2])
            parts.append(f"<table><tr>{head}</tr>{body}</table>")
        elif kind == "img":
            data = base64.b64encode(Path(b[1]).read_bytes()).decode()
            parts.append(
                f"<figure><img src='data:image/png;base64,{data}' alt='{e(b[2])}'>"
                f"<figcaption>{inline(b[2])}</figcaption></figure>"
            )
        elif kind == "tokens":
            parts.append(f"<p><b>{inline(b[1])}</b> (wrong tokens in red)</p><ul>")
            for ref, toks in b[2]:
                rebuilt = " ".join(e(t) if ok else f"<span class='bad'>{e(t)}</span>" for t, ok in toks)
                parts.append(f"<li>true: {e(ref)}<br>rebuilt: {rebuilt}</li>")
            parts.append("</ul>")
        elif kind == "glance":
            parts.append(f"<p><b>{inline(b[1])}</b></p><ul class='glance'>")
            for d, cost, leak, v, says in b[2]:
                parts.append(
                    f"<li class='{v}'><span class='verdict {v}'>{v}</span><code>{inline(d)}</code> — "
                    f"{inline(cost)}; worst case {inline(leak)} — {inline(says)}</li>"
                )
            parts.append("</ul>")
    parts.append("</body></html>")
    return "\n".join(parts)
