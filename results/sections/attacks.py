"""Section attacks (the image tables): APRIL's closed form in the MJP paper's settings (a)-(c),
label recovery by batch size, and the optimisation attacks (IG, DLG) at init and trained, from
configs/paper/attacks_image.yaml. The text tables follow in section attacks-text."""

from __future__ import annotations

from typing import Any

from results.notes import notes
from results.tables import entry_label, fmt, raw_tasks, table

NOTES = notes(__name__)

SOURCES = ("attacks-image",)
#: APRIL rows: (label, defense shown, setting, task, defense key)
APRIL = (
    ("vit-digits, digits 8x8", "none", "(a) original", "april-vit-digits", "none"),
    ("vit-tiny (1 ch), LFW 32x32", "none", "(a) original", "april-vit-tiny-lfw", "none"),
    ("hf-vit (1 ch), LFW 32x32", "none", "(a) original", "april-hf-vit-lfw", "none"),
    ("vit-digits, digits 8x8", "mjp γ=0.27", "(b) shuffled", "april-vit-digits-shuffled", "mjp(gamma=0.27)"),
    ("vit-digits, digits 8x8", "mjp γ=0.27", "(c) original", "april-vit-digits", "mjp(gamma=0.27)"),
)
APRIL_MJP_NOTE = NOTES["APRIL_MJP_NOTE"]
IG_NOTE = NOTES["IG_NOTE"]


def _april(s: dict[str, Any]) -> str:
    rows = []
    for label, defense, setting, task, key in APRIL:
        m = s["tasks"][task]["leakage"][key]["april"]
        rows.append(
            [label, defense, setting, fmt(m["psnr"], 2), fmt(m["ssim"]), fmt(m["mse"], 5), fmt(m["fft2d"])]
            + [fmt(m["seconds"], 4)]
        )
    n = s["tasks"]["april-vit-digits"]["samples"]
    header = ["model / data", "defense", "setting (scored against)", "PSNR dB", "SSIM", "MSE", "FFT2D", "s/image"]
    title = f"### APRIL (closed form), batch 1, {n} test images, weights at init"
    return f"{title}\n\n{table(header, rows)}\n\n{APRIL_MJP_NOTE}"


def _labels(s: dict[str, Any]) -> str:
    tasks = [t for name, t in s["tasks"].items() if name.startswith("labels-")]
    rows = [[t["knowledge"]["batch_size"], fmt(t["leakage"]["none"]["labels"]["label_accuracy"])] for t in tasks]
    title = f"### Label recovery from the head's bias gradient (vit-digits, init, {tasks[0]['samples']} batches)"
    return f"{title}\n\n{table(['batch size', 'label multiset recovered'], rows)}"


def _optimisation(s: dict[str, Any]) -> str:
    raw, rows, n = raw_tasks(s), [], 0
    for name in ("optimisation-init", "optimisation-trained"):
        t, r = s["tasks"][name], raw[name]
        n = t["samples"]
        state = "init"
        if r.get("weights", "trained") == "trained":
            state = f"trained {r['run']['train']['epochs']} ep (acc {t['utility']['none']['test_accuracy_mean']:.2f})"
        for entry in r["attacks"]:
            m = t["leakage"]["none"][entry_label(entry)]
            rows.append(
                [entry["name"], entry.get("layers", "all"), state, f"{entry['iterations']} x {entry['restarts']}"]
                + [fmt(m["psnr"], 2), fmt(m["ssim"]), fmt(m.get("iterations_per_second"), 1), fmt(m["seconds"], 1)]
            )
    header = ["attack", "gradients compared", "model state", "iterations x restarts", "PSNR dB", "SSIM", "it/s"]
    title = f"### Optimisation attacks on vit-digits, batch 1, {n} test digits"
    return f"{title}\n\n{IG_NOTE}\n\n{table(header + ['s/image'], rows)}"


def render(summary: dict[str, Any]) -> str:
    note = (
        "Measured on this machine (CPU, torch threads=1) by `veil audit configs/paper/attacks_image.yaml`, rendered by "
        "`python -m results`; never edit by hand. Clients trained without dropout (dropout=0 in these models)."
    )
    parts = [_april(summary), _labels(summary), _optimisation(summary)]
    return "## Attacks\n\n" + note + "\n\n" + "\n\n".join(parts)
