"""The report's blocks as Markdown and as one self-contained HTML page (PNGs embedded).

Blocks: ("h1" | "h2" | "h3", text), ("p", text), ("pre", text), ("table", header, rows),
("img", path, caption), ("tokens", title, [(reference, [(token, right)])]) and
("glance", title, [[defense, cost, leakage, verdict, says]]) (veil.report.headline) and
("matrix", title, defenses, accuracy, rows) (veil.report.matrix).

The page is laid out to be read at a glance and checked in a headless browser
(tests/test_report.py): nothing is clipped or overlaps from a narrow window (800 px) to a wide
one. Long labels (`ig(iterations=150,restarts=1)`, `psnr_unshuffled`) get break points after
commas, underscores and `=` and never break inside a word; numbers stay on one line;
pre-formatted text wraps. A table or figure wider than the window scrolls inside its own box
(`div.scroll`), so the page itself never does; figures are shown at their natural size.
"""

from __future__ import annotations

import base64
import html
import re
from pathlib import Path

from veil.report.figures import COLOURS
from veil.report.matrix import VERDICTS, css_class, matrix_markdown

CSS = (
    "body{font-family:system-ui,sans-serif;max-width:1180px;margin:1em auto;padding:0 1em;color:#222;line-height:1.4}",
    "h1{font-size:1.6em;margin:.3em 0}",
    "div.scroll{max-width:100%;overflow-x:auto;margin:.5em 0 1.2em}div.scroll>table{margin:0}",
    "table{border-collapse:collapse;margin:.5em 0 1.2em}",
    "td,th{border:1px solid #ccc;padding:3px 7px;font-size:13px;text-align:left;overflow-wrap:normal;vertical-align:top}",
    "th{background:#f3f3f3}td.num{text-align:right;white-space:nowrap}",
    ".bad{color:#b00;text-decoration:line-through}code{font-size:92%;background:#f3f3f3;padding:0 .2em}",
    "pre{background:#f6f6f6;padding:1em;font-size:12px;white-space:pre-wrap;overflow-wrap:anywhere}",
    "p,li,figcaption,h1,h2,h3{overflow-wrap:break-word}span.nw{white-space:nowrap}",
    "figure{margin:1em 0}figure img{display:block}figcaption{font-size:12px;color:#555;max-width:960px}",
    "ul.glance{list-style:none;padding-left:0;margin:.3em 0 1em}ul.glance li{margin:.25em 0;padding-left:.6em}",
    ".verdict{display:inline-block;min-width:4.5em;text-align:center;color:#fff;border-radius:3px;"
    "padding:0 .4em;margin-right:.4em;font-weight:600;font-size:13px}",
    *(f"li.{v}{{border-left:5px solid {c}}}.verdict.{v}{{background:{c}}}" for v, c in COLOURS.items() if " " not in v),
    "div.mblock{display:inline-block;vertical-align:top;max-width:100%;margin-right:2em}",
    "table.matrix{margin:.2em 0 .6em}table.matrix td,table.matrix th{font-size:13px;padding:2px 6px;white-space:nowrap}",
    "table.matrix td.v{color:#fff;font-weight:600;text-align:center}table.matrix td.acc{text-align:center;background:#f7f7f7}",
    "p.mtitle{margin:.6em 0 0}p.key{font-size:12px;margin:.2em 0 .8em}p.key span.k{padding:0 .4em;margin-right:.3em;color:#fff;white-space:nowrap}",
    *(f"td.v.{css_class(v)},p.key span.k.{css_class(v)}{{background:{COLOURS[v]}}}" for v in VERDICTS),
    "table.matrix td.v.not-run,p.key span.k.not-run{color:#333}",
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
        elif kind == "matrix":
            lines += matrix_markdown(b)
        elif kind == "key":
            lines += [b[2], ""]
    return "\n".join(lines)


def matrix_html(block: tuple) -> str:
    """The defense x attack matrix as an HTML table: cells coloured by verdict, the reason in a tooltip."""
    _, title, defenses, accuracy, rows = block
    e = html.escape
    head = "".join(f"<th><code>{inline(d)}</code></th>" for d in defenses)
    acc = "".join(f"<td class='acc'>{e(a)}</td>" for a in accuracy)
    body = []
    for a, cells in rows:
        tds = "".join(
            f"<td class='v {css_class(v)}' title='{e(v + (': ' + why if why else ''))}'>"
            + (e(v) if f in (v, "n/a", "—", "") else f"{e(v)} · {e(f)}")
            + "</td>"
            for v, f, why in cells
        )
        body.append(f"<tr><th><code>{inline(a)}</code></th>{tds}</tr>")
    return (
        f"<div class='mblock'><p class='mtitle'><b>{inline(title)}</b></p><div class='scroll'><table class='matrix'>"
        f"<tr><th>attack \\ defense</th>{head}</tr><tr><th>test accuracy (vs none)</th>{acc}</tr>"
        + "".join(body)
        + "</table></div></div>"
    )


NAME = re.compile(r"[^\s<>]*[-_=(][^\s<>]*")


def _names(escaped: str) -> str:
    """Each word that holds - _ = or ( (a name such as `ig(iterations=150,restarts=1)`) kept on one
    line, breakable only after its commas."""

    def keep(m: re.Match[str]) -> str:
        return ",<wbr>".join(f"<span class='nw'>{p}</span>" if p else "" for p in m.group(0).split(","))

    return NAME.sub(keep, escaped)


def header(text: str) -> str:
    """A table's column header: a metric's name (`unshuffled_recovery`, `psnr (dB)`) may break
    after its underscores, between its words, so a table of many metrics fits a narrow window;
    any other header (a defense's label) is `inline` text."""
    if re.fullmatch(r"[a-z0-9]+(_[a-z0-9]+)+( \([^()]*\))?", text):
        return html.escape(text).replace("_", "_<wbr>")
    return inline(text)


def inline(text: str) -> str:
    """Escaped text with `code` spans and **bold**; names never break inside (see `_names`)."""
    parts = re.split(r"(`[^`]+`)", text)
    out = []
    for k, part in enumerate(parts):
        if k % 2:  # a code span
            out.append(f"<code>{_names(html.escape(part[1:-1]))}</code>")
        else:
            out.append(re.sub(r"\*\*([^*]+)\*\*", r"<b>\1</b>", _names(html.escape(part))))
    return "".join(out)


NUMBER = re.compile(r"^(—|exact \(∞\)|-?inf|[-+]?\d[\d.]*(e[-+]?\d+)?(×| s| dB)?( ± [\d.]+)?( \([\d.–-]+\))?)$")


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
            head = "".join(f"<th>{header(str(h))}</th>" for h in b[1])
            body = "".join("<tr>" + "".join(cell(c) for c in row) + "</tr>" for row in b[2])
            parts.append(f"<div class='scroll'><table><tr>{head}</tr>{body}</table></div>")
        elif kind == "img":
            data = base64.b64encode(Path(b[1]).read_bytes()).decode()
            parts.append(
                f"<figure><div class='scroll'><img src='data:image/png;base64,{data}' alt='{e(b[2])}'></div>"
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
        elif kind == "matrix":
            parts.append(matrix_html(b))
        elif kind == "key":
            spans = "".join(f"<span class='k {css_class(v)}'>{e(v)}</span>" for v in b[1])
            parts.append(f"<p class='key'>{spans} {inline(b[2])}</p>")
    parts.append("</body></html>")
    return "\n".join(parts)
