"""Regenerate the attacks section of docs/results.md (between `<!-- attacks:start -->` and
`<!-- attacks:end -->`; every other section is kept).

One function per table, each returning Markdown; text tables come from
`scripts/results_attacks_text.py` (function `tables() -> list[str]`) when that file exists.

    python scripts/results_attacks.py [--samples 8] [--ig-iterations 600] [--only april,labels]

With --only, the tables not regenerated are kept as they stand in the section (matched by heading).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from veil.build import build_run
from veil.commands.attack import attack_run
from veil.config import load_config

sys.path.insert(0, str(Path(__file__).resolve().parent))
from resultsdoc import fmt, write_section  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results.md"


def audit(overrides: list[str], attack: str, settings: dict[str, Any] | None = None, **kw: Any) -> dict[str, float]:
    """Build a run at its seeded init from overrides and return the attack's mean metrics."""
    model, data, defenses = build_run(load_config(None, overrides))
    return attack_run(model, data, defenses, attack, settings or {}, **kw)["attacks"][attack]


def april_table(samples: int) -> str:
    """APRIL on undefended and MJP ViTs; settings (a)/(b)/(c) of the MJP paper."""
    rows = [
        ("vit-digits, digits 8x8", "none", "(a) original", ["model=vit-digits", "data=digits"], "original"),
        ("vit-tiny (1 ch), LFW 32x32", "none", "(a) original", ["model=vit-tiny", "data=lfw"], "original"),
        (
            "hf-vit (1 ch), LFW 32x32",
            "none",
            "(a) original",
            ["model=hf-vit", "data=lfw", "model.dim=96", "model.depth=2", "model.heads=3"],
            "original",
        ),
        (
            "vit-digits, digits 8x8",
            "mjp γ=0.27",
            "(b) shuffled",
            ["model=vit-digits", "data=digits", "defense=mjp", "defense.gamma=0.27"],
            "shuffled",
        ),
        (
            "vit-digits, digits 8x8",
            "mjp γ=0.27",
            "(c) original",
            ["model=vit-digits", "data=digits", "defense=mjp", "defense.gamma=0.27"],
            "original",
        ),
    ]
    lines = [
        f"### APRIL (closed form), batch 1, {samples} test images, weights at init",
        "",
        "| model / data | defense | setting (scored against) | PSNR dB | SSIM | MSE | FFT2D | s/image |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, defense, setting, over, ref in rows:
        m = audit(over, "april", samples=samples, reference=ref)
        lines.append(
            f"| {label} | {defense} | {setting} | {fmt(m['psnr'], 2)} | {fmt(m['ssim'], 3)} | {fmt(m['mse'], 5)} | {fmt(m['fft2d'], 3)} | {fmt(m['seconds'], 4)} |"
        )
    return "\n".join(lines + ["", APRIL_MJP_NOTE])


APRIL_MJP_NOTE = '*The MJP rows are the naive `april`, which ignores the mechanism: they show that this attack fails, not that MJP protects. `april-mjp`, which knows MJP, rebuilds the unshuffled patches of such updates exactly and the masked ones as a set (section "Adaptive attacker on MJP (images)"; verdict in "Seed claims").*'


def train_briefly(model: torch.nn.Module, split: dict, epochs: int, seed: int = 0) -> float:
    """A few AdamW epochs so the attacked model is not at init; returns test accuracy."""
    from veil.data import iterate_batches

    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    model.train()
    for ep in range(epochs):
        for b in iterate_batches(split["train"], 32, shuffle=True, generator=torch.Generator().manual_seed(seed + ep)):
            opt.zero_grad()
            model.loss(model(b), b).backward()
            opt.step()
    with torch.no_grad():
        acc = (model(split["test"]).argmax(-1) == split["test"]["labels"]).float().mean()
    return float(acc)


def inverting_table(samples: int, iterations: int, restarts: int, epochs: int) -> str:
    """IG (input layers, its default; and all layers, the paper's objective) and DLG on vit-digits,
    batch 1, at init and after a short training."""
    lines = [
        f"### Optimisation attacks on vit-digits, batch 1, {samples} test digits",
        "",
        "IG: cosine + TV (1e-4), signed Adam lr 0.1 with cosine decay, box [0, 1], label read from the head's "
        "bias gradient, restarts kept by gradient loss; `input` compares only the patch-embedding and position "
        "gradients (the default), `all` every exported gradient (the paper's objective). DLG: L2 over all layers, "
        "L-BFGS, soft label.",
        "",
        "| attack | gradients compared | model state | iterations x restarts | PSNR dB | SSIM | it/s | s/image |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for state in ("init", f"trained {epochs} ep"):
        model, data, defenses = build_run(load_config(None, ["model=vit-digits", "data=digits"]))
        if state != "init":
            acc = train_briefly(model, {"train": data.train, "test": data.test}, epochs)
            state += f" (acc {acc:.2f})"
        for name, layers, settings in (
            ("ig", "input", {"iterations": iterations, "restarts": restarts, "layers": "input"}),
            ("ig", "all", {"iterations": iterations, "restarts": restarts, "layers": "all"}),
            ("dlg", "all", {"iterations": iterations // 4, "restarts": 1}),
        ):
            m = attack_run(model, data, defenses, name, settings, samples=samples)["attacks"][name]
            its = settings["iterations"]
            lines.append(
                f"| {name} | {layers} | {state} | {its} x {settings['restarts']} | {fmt(m['psnr'], 2)} | {fmt(m['ssim'], 3)} | "
                f"{fmt(m.get('iterations_per_second'), 1)} | {fmt(m['seconds'], 1)} |"
            )
    return "\n".join(lines)


def labels_table(samples: int) -> str:
    """Label recovery share on vit-digits at init for several batch sizes."""
    lines = [
        f"### Label recovery from the head's bias gradient (vit-digits, init, {samples} batches)",
        "",
        "| batch size | label multiset recovered |",
        "|---|---|",
    ]
    for b in (1, 4, 8, 16):
        m = audit(["model=vit-digits", "data=digits"], "labels", samples=samples, batch_size=b)
        lines.append(f"| {b} | {fmt(m['label_accuracy'], 3)} |")
    return "\n".join(lines)


def text_tables(
    quick: bool, parts: tuple[str, ...] = ("span", "decoder", "opt"), span_samples: int | None = None
) -> list[str]:
    path = Path(__file__).with_name("results_attacks_text.py")
    if not path.is_file():
        return []
    spec = importlib.util.spec_from_file_location("results_attacks_text", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses in the module look themselves up there
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return list(mod.tables(quick=quick, parts=parts, span_samples=span_samples))


def old_tables(path: Path = RESULTS) -> list[str]:
    """The tables (### blocks) of the attacks section as it stands in docs/results.md."""
    text = path.read_text() if path.is_file() else ""
    start, end = "<!-- attacks:start -->", "<!-- attacks:end -->"
    if start not in text or end not in text:
        return []
    body = text.split(start, 1)[1].split(end, 1)[0]
    return ["### " + b.strip() for b in body.split("\n### ")[1:]]


def splice(old: list[str], new: list[str]) -> list[str]:
    """Each regenerated table replaces the old one with the same heading (up to its first comma);
    the tables not regenerated are kept, in their order; new headings are appended."""

    def key(table: str) -> str:
        return table.split("\n", 1)[0].split(",", 1)[0].strip()

    fresh = {key(t): t for t in new}
    out = [fresh.pop(key(t), t) for t in old]
    return out + [t for t in new if key(t) in fresh]


FULL = ("april", "labels", "inverting", "text")  # every table; "span" / "span-decoder" are subsets of "text"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--ig-iterations", type=int, default=600)
    ap.add_argument("--ig-restarts", type=int, default=2)
    ap.add_argument("--train-epochs", type=int, default=10)
    ap.add_argument("--only", default=",".join(FULL))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick-text", action="store_true", help="text rows in quick mode (one batch per cell)")
    ap.add_argument("--span-samples", type=int, default=8, help="batches per span cell for --only span")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    only = set(args.only.split(","))
    makers: list[tuple[str, Callable[[], str | list[str]]]] = [
        ("april", lambda: april_table(args.samples)),
        ("labels", lambda: labels_table(args.samples)),
        (
            "inverting",
            lambda: inverting_table(min(args.samples, 4), args.ig_iterations, args.ig_restarts, args.train_epochs),
        ),
        ("text", lambda: text_tables(args.quick_text)),
        ("span", lambda: text_tables(False, ("span",), args.span_samples)),  # the span tables alone
        ("span-decoder", lambda: text_tables(False, ("decoder",), args.span_samples)),
    ]
    parts, t0 = [], time.time()
    for key, make in makers:
        if key in only:
            out = make()
            parts.extend(out if isinstance(out, list) else [out])
            print(f"[{time.time() - t0:.0f}s] {key} done", flush=True)
    if only != set(FULL):  # a partial run keeps the other tables of the section
        parts = splice(old_tables(), parts)
    note = (
        f"Measured on this machine (CPU, torch threads={args.threads}) by `scripts/results_attacks.py`; "
        "regenerate, never edit by hand. Clients trained without dropout (dropout=0 in these models)."
    )
    write_section("attacks", "## Attacks\n\n" + note + "\n\n" + "\n\n".join(parts) + "\n")


if __name__ == "__main__":
    main()
