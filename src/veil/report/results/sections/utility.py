"""Section utility: test accuracy (or perplexity) per defense on pretrained / Hugging Face models,
and each defense's difference to undefended with its standard error, from
configs/paper/minilm_utility.yaml (`summary.tasks[t].utility`, `overhead`)."""

from __future__ import annotations

from math import sqrt
from statistics import mean, stdev
from typing import Any

from veil.report.results.tables import mean_std, table

SOURCES = ("minilm-utility",)
NOTE = (
    "Trained by `veil audit configs/paper/minilm_utility.yaml`, rendered by `python -m veil.report.results`; never edit "
    "by hand (seeds {seeds}; the seeds column counts the runs). MiniLM: all 8,000 "
    "shipped SST-2 sentences, 32 tokens, 2 epochs, lr 1e-4, mean pooling, dropout 0.1; test = the 872-sentence GLUE dev "
    "split. GPT-2: from a config (2 layers, width 128), AG News text, 3,000 texts, 2 epochs; accuracy = next-token "
    "accuracy. Goal (MJP and AEGIS issues): MiniLM with the defense within 1 point of undefended. Step-time ratios come "
    "from the audit's interleaved measurement (`veil.experiments.cells.step_overhead`, batch 32; noisy on a shared "
    "machine). The s.e. column is the standard error of the difference of two seed means "
    "(sample std over seeds): a difference within about one s.e. of the -1 point line is a pass or a miss at the "
    "noise level of 3 seeds, not a margin. `unk_init=mean` starts MJP's E_unk at the pretrained position table's "
    "mean row instead of at random (see `veil.defenses.mjp`). `aegis(lr_scale=3.0)` trains what AEGIS leaves trainable "
    "at 3x the task's learning rate (3e-4), the scale chosen on a validation split of the training pool (next section), "
    "never on this test split. On GPT-2 (a causal model) `aegis` noises the MLP down-projection too (veil's default "
    "there); `aegis(mlp_down_noise=0.0)` is AEGIS as published. DP-SGD runs at noise multiplier 0.1, the lowest level "
    "that matched AEGIS's attack resistance on MiniLM (AEGIS section), per-sample clip 1.0, same recipe."
)


def _rows(name: str, t: dict[str, Any]) -> list[list[str]]:
    base = t["utility"].get("none", {}).get("test_accuracy_values", [])
    rows = []
    for d in sorted(t["utility"], key=lambda d: (d != "none", d)):
        u = t["utility"][d]
        acc, ppl = u.get("test_accuracy_values", []), u.get("test_perplexity_values", [])
        delta = se = within = "—"
        if d != "none" and base and acc:
            diff = 100 * (mean(acc) - mean(base))
            delta, within = f"{diff:+.2f}", ("yes" if diff >= -1.0 else "no")
            if len(acc) > 1 and len(base) > 1:
                se = f"{100 * sqrt(stdev(acc) ** 2 / len(acc) + stdev(base) ** 2 / len(base)):.2f}"
        within = "—" if ppl else within  # the 1-point goal is on classification accuracy
        ratio = t.get("overhead", {}).get(d)
        rows.append(
            [f"{name} ({t['model']})", d, len(acc), mean_std(acc, 100.0) if acc else "—", delta, se, within]
            + [mean_std(ppl, 1.0, 1) if ppl else "—", "—" if ratio is None else f"{ratio:.2f}"]
        )
    return rows


def render(summary: dict[str, Any]) -> str:
    header = ["task", "defense", "seeds", "test accuracy (%)", "minus undefended (points)", "s.e. of that difference"]
    header += ["within 1 point", "test perplexity", "step time vs none"]
    rows = [r for name, t in summary["tasks"].items() for r in _rows(name, t)]
    title = "## Utility of MJP and AEGIS on pretrained / Hugging Face models"
    return f"{title}\n\n{NOTE.format(seeds=summary['seeds'])}\n\n{table(header, rows)}"
