"""The results sections of the DP-SGD scenarios (dp, dp-glue, aegis-screen) render what the audit's
summaries hold: each figure from its source, the verdicts from the numbers, the epsilon of a noise
level at a stated schedule from Opacus' accountant."""

from __future__ import annotations

from typing import Any

import pytest

from results.sections import aegis_screen, dp, dp_glue

DP = {"name": "dpsgd", "clip": 1.0, "trainable": "classifier"}


def _label(e: dict[str, Any]) -> str:
    extra = ",".join(f"{k}={v}" for k, v in sorted(e.items()) if k != "name")
    return f"{e['name']}({extra})" if extra else e["name"]


def _util(accs: list[float], sigma: float = 0.7, eps: float = 8.0, n: int = 8000) -> dict[str, Any]:
    privacy = {"epsilon": eps, "delta": 1 / n, "noise_multiplier": sigma, "sample_rate": 512 / n, "steps": 80}
    mean = sum(accs) / len(accs)
    return {"test_accuracy_values": accs, "test_accuracy_mean": mean, "train_seconds_mean": 3.0, "privacy": privacy}


def _curve(name: str, eight: list[float], n: int = 8000) -> dict[str, Any]:
    entries = [{**DP, "target_epsilon": 1.0}, {**DP, "target_epsilon": 8.0}, {**DP, "noise_multiplier": 0.0}]
    accs = [[0.78, 0.79, 0.78], eight, [0.79, 0.80, 0.79]]
    util = {_label(e): _util(a, n=n) for e, a in zip(entries, accs)}
    return {
        "seeds": [0, 1, 2],
        "tasks": {name: {"utility": util, "leakage": {}, "blocked": {}}},
        "config": {"tasks": [{"name": name, "defenses": entries}]},
    }


def _screen(accs: dict[str, float]) -> dict[str, Any]:
    e = {**DP, "target_epsilon": 8.0}
    tasks = {n: {"utility": {_label(e): _util([a], n=7000)}} for n, a in accs.items()}
    return {"seeds": [0], "tasks": tasks, "config": {"tasks": [{"name": n, "defenses": [e]} for n in accs]}}


def test_the_dp_section_reads_the_curve_the_screen_the_bench_and_both_attack_tables() -> None:
    noisy = "dpsgd(clip=1.0,noise_multiplier=0.1)"
    cells = {"presence": {"presence_f1": 0.003, "presence_random_f1": 0.003, "presence_guesses": 9, "seconds": 1.0}}
    ladder = {"tasks": {"minilm": {"leakage": {"none": {}, noisy: cells}, "blocked": {}}}}
    part = "dpsgd(clip=1.0,noise_multiplier=0.7208251953125,trainable=classifier)"
    recipe = {"tasks": {"minilm": {"leakage": {}, "blocked": {part: {"presence": "no gradient for the embedding"}}}}}
    bench = {"batch": 16, "len": 32, "repeats": 6, "threads": 1, "veil_ghost_over_opacus_ghost": 1.062}
    bench |= {"median_s": {"none": 5.0, "veil-ghost": 11.0}, "ratio_to_none": {"none": 1.0, "veil-ghost": 2.2}}
    out = dp.render(
        {
            "dp-minilm": _curve("recipe", [0.797, 0.798, 0.796]),
            "dp-minilm-screen": _screen({"head-lr3e-2-B512-E5": 0.832, "top1-lr1e-3-B512-E5": 0.76}),
            "dp-attacks": recipe,
            "aegis-attacks": ladder,
            "bench/dp-step": bench,
        }
    )
    assert "not met with the 8,000 shipped sentences: 79.70 ± 0.08 (3 seeds)" in out
    assert "The best validation row: `head-lr3e-2-B512-E5`" in out and "reached 76.00 % on validation" in out
    assert "training on the other 7,000, delta 1/7,000" in out
    assert "veil ghost / Opacus ghost = **1.062**" in out and "| veil-ghost | 11.000 | 2.20 |" in out
    assert "| none |" not in out.split("Worst case")[1]  # only DP-SGD rows of the AEGIS ladder
    # sigma 0.1 at the utility schedule (q = 32/8000, 500 steps) costs epsilon in the thousands
    assert f"| minilm | {noisy} | 2.31e+03 |" in out and "minilm: noise multiplier 0.1" in out
    assert f"| minilm (recipe parts) | {part} | 1.75 | " in out


def test_the_glue_section_judges_the_goal_on_the_smallest_seed_and_names_each_attacked_update() -> None:
    entries = [{**DP, "noise_multiplier": 0.0, "seed": 7}, {"name": "aegis"}]
    leak = {_label(entries[0]): {"head-embedding": {"exact_recovery": 1.0, "match_cosine": 1.0, "match_pool": 872.0}}}
    leak["aegis"] = {"head-embedding": {"exact_recovery": 0.969, "match_cosine": 0.998, "match_pool": 872.0}}
    attack = {"tasks": {"minilm": {"samples": 32, "leakage": leak, "blocked": {}}}}
    attack["config"] = {"tasks": [{"name": "minilm", "defenses": entries}]}
    src = {"dp-glue-screen": _screen({"lr3e-2-B2048-E10": 0.845}), "dp-head-embedding": attack}
    met = dp_glue.render({**src, "dp-glue": _curve("recipe", [0.811, 0.807, 0.815], n=60614)})
    assert "— met: 81.10 ± 0.33 (3 seeds, min 80.70)" in met and "N = 60,614" in met
    assert "| head only, no noise | 0 | 32 | 872 | 100.0 % | 1.000 |" in met
    assert "| whole model, aegis | — | 32 | 872 | 96.9 % | 0.998 |" in met
    short = dp_glue.render({**src, "dp-glue": _curve("recipe", [0.811, 0.799, 0.815], n=60614)})
    assert "— NOT met" in short


def test_the_aegis_screen_reads_each_seed_against_undefended_at_the_base_lr() -> None:
    entries = ["none", {"name": "aegis", "lr_scale": 3.0}]
    util = {
        "none": {"test_accuracy_values": [0.865, 0.839]},
        "aegis(lr_scale=3.0)": {"test_accuracy_values": [0.858, 0.833]},
    }
    tasks = {"lr1e-4": {"model": "minilm", "utility": util}, "lr3e-4": {"utility": {"none": util["none"]}}}
    raw = [
        {
            "name": "lr1e-4",
            "run": {"train": {"lr": 1e-4}, "data": {"val_size": 1000, "train_size": 2000}},
            "defenses": entries,
        },
        {"name": "lr3e-4", "run": {"train": {"lr": 3e-4}}, "defenses": ["none"]},
    ]
    out = aegis_screen.render({"seeds": [0, 1], "tasks": tasks, "config": {"tasks": raw}})
    assert "on 1,000 sentences held out" in out and "training on 2,000 others" in out
    assert (
        "| 0.0001 | `aegis(lr_scale=3.0)` | AEGIS, what it trains at 3x the lr (3e-4) | 1 | 83.30 | -0.60 | — |" in out
    )
    assert "| 0.0003 | `none` | undefended | 0 | 86.50 | +0.00 | — |" in out
    assert "| 0.0001 | `none` | undefended | 0 | 86.50 | — |" in out


@pytest.mark.parametrize("module", [dp, dp_glue, aegis_screen])
def test_each_section_names_its_collected_sources(module: Any) -> None:
    assert module.SOURCES and all(isinstance(s, str) for s in module.SOURCES)
