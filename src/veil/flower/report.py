"""report.html of a `veil.flower` audit folder: per round and attack, what the server saw, what the
attacker knows, the attack's evidence (or scores, where a truth was given) and the reconstruction.
The worst case is named per threat model (one client's update / an aggregate): the attack whose
rebuild explains its update best (lowest matching loss; highest score where scored)."""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

from veil.io import atomic_write_text

SCORES = ("psnr", "ssim", "label_accuracy", "presence_f1", "token_recovery")
SHOWN = ("seconds", "stats_loss", "image_tv", "image_std", "labels", *SCORES)


def _events(folder: Path) -> list[dict[str, Any]]:
    path = folder / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln]


def _cell(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return html.escape(str(v))


def worst_cases(audits: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per threat model (``server_saw`` without the client count), the strongest finding."""
    out: dict[str, dict[str, Any]] = {}
    for e in audits:
        if "skipped" in e or "error" in e:
            continue
        key = "one client's update" if e["server_saw"] == "one client's update" else "an aggregate"
        rank = next((e[s] for s in SCORES if s in e), -float(e.get("stats_loss", 0.0)))
        if key not in out or rank > out[key]["_rank"]:
            out[key] = {**e, "_rank": rank}
    return out


def write_report(folder: Path) -> Path:
    """(Re)write folder/report.html from folder/metrics.jsonl."""
    audits = [e for e in _events(folder) if e.get("event") == "audit"]
    cols = [c for c in SHOWN if any(c in e for e in audits)]
    rows = []
    for e in audits:
        status = e.get("skipped") or e.get("error") or ""
        imgs = "".join(
            f'<img src="{html.escape(p)}" height="48">' for p in e.get("saved", []) if str(p).endswith(".png")
        )
        cells = "".join(f"<td>{_cell(e.get(c, ''))}</td>" for c in cols)
        rows.append(
            f"<tr><td>{e['round']}</td><td>{_cell(e['client'])}</td><td>{_cell(e['attack'])}</td>"
            f"<td>{_cell(e.get('server_saw', ''))}</td><td>{_cell(e.get('knows', ''))}</td>{cells}"
            f"<td>{_cell(status)}</td><td>{imgs}</td></tr>"
        )
    worst = "".join(
        f"<li><b>{html.escape(k)}</b>: {html.escape(str(w['attack']))} in round {w['round']} "
        f"(client {_cell(w['client'])}; attacker knows: {html.escape(str(w.get('knows', '')))})</li>"
        for k, w in worst_cases(audits).items()
    )
    head = "".join(
        f"<th>{html.escape(c)}</th>"
        for c in ["round", "client", "attack", "server saw", "attacker knows", *cols, "note", "reconstruction"]
    )
    page = (
        "<!doctype html><html><head><meta charset='utf-8'><title>veil audit</title>"
        "<style>body{font-family:sans-serif}td,th{border:1px solid #ccc;padding:2px 6px;font-size:12px}"
        "table{border-collapse:collapse}</style></head><body>"
        "<h1>veil audit of a Flower app: what the server could rebuild</h1>"
        f"<h2>Worst case per threat model</h2><ul>{worst or '<li>no attack produced a reconstruction yet</li>'}</ul>"
        f"<h2>Per round</h2><table><tr>{head}</tr>{''.join(rows)}</table></body></html>\n"
    )
    path = folder / "report.html"
    atomic_write_text(path, page)
    return path
