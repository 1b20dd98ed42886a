"""The audit's verdict is the worst case: the selection picks the highest leakage (constructed
cells, hand-computed scores), blocked attacks are shown as blocked beside the one that worked,
and the summary.json keys stay stable."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from veil.metrics.leakage import KEYS, cell_leakage, worst_case
from veil.report.render import write_reports

KNOWS = {
    "april": "naive",
    "april-mjp": "the MJP mechanism",
    "span": "naive",
    "span-mjp": "the MJP mechanism",
    "presence": "naive",
    "tag": "naive",
    "labels": "naive",
    "ig": "naive",
}


def test_image_worst_case_is_the_best_region_of_the_strongest_attack() -> None:
    leak = {
        "april": {"psnr": 10.6, "ssim": 0.4},
        "april-mjp": {
            "psnr": 12.0,
            "ssim": 0.5,
            "psnr_unshuffled": 97.0,
            "ssim_unshuffled": 1.0,
            "masked_patches": 2.0,
        },
        "ig": {"psnr": 9.1, "ssim": 0.39, "label_accuracy": 1.0},
    }
    wc = worst_case(leak, KNOWS)
    assert (wc["attack"], wc["metric"], wc["value"], wc["region"]) == (
        "april-mjp",
        "psnr_unshuffled",
        97.0,
        "unshuffled patches",
    )
    assert wc["knows"] == "the MJP mechanism"
    assert wc["beside"] == {"ssim_unshuffled": 1.0, "psnr": 12.0, "masked_patches": 2.0}
    assert wc["ranking"] == ["april-mjp", "april", "ig"]


def test_whole_image_wins_when_it_is_higher_and_nan_regions_are_ignored() -> None:
    wc = worst_case({"april-mjp": {"psnr": 30.0, "psnr_unshuffled": float("nan")}, "april": {"psnr": 31.5}}, KNOWS)
    assert (wc["attack"], wc["metric"], wc["region"]) == ("april", "psnr", "whole image")
    # both exact (above 100 dB): a tie, named by the attack listed first (the naive one)
    assert worst_case({"april": {"psnr": 115.4}, "april-mjp": {"psnr": 116.4}}, KNOWS)["attack"] == "april"
    assert worst_case({"april-mjp": {"psnr": 116.4}, "april": {"psnr": float("inf")}}, KNOWS)["attack"] == "april-mjp"
    assert (
        worst_case({"april": {"psnr": 30.0004}, "ig": {"psnr": 30.0001}}, KNOWS)["attack"] == "april"
    )  # equal at 3 decimals
    assert worst_case({"april": {"psnr": 30.0}, "ig": {"psnr": 30.01}}, KNOWS)["attack"] == "ig"


def test_text_worst_case_counts_words_and_positions() -> None:
    leak = {
        "presence": {"presence_f1": 1.0},  # the whole bag, nothing in place: 1.0
        "span": {"token_recovery": 0.336, "rouge1": 0.491, "presence_f1": 0.969},  # 0.969 + 0.336 = 1.305
        "span-mjp": {"token_recovery": 0.7, "rouge1": 0.96, "presence_f1": 0.98, "exact_recovery": 0.0},  # 0.98 + 0.7
        "tag": {"token_recovery": 0.0, "rouge1": 0.011},
    }
    wc = worst_case(leak, KNOWS)
    assert (wc["attack"], wc["metric"], wc["value"], wc["region"]) == ("span-mjp", "presence_f1", 0.98, "bag of words")
    assert wc["score"] == pytest.approx(1.68)
    assert wc["beside"] == {"token_recovery": 0.7, "exact_recovery": 0.0}
    assert wc["ranking"] == ["span-mjp", "span", "presence", "tag"]
    assert cell_leakage(leak["span"])["score"] == pytest.approx(0.969 + 0.336)


def test_labels_only_rank_below_any_rebuilt_input() -> None:
    wc = worst_case({"labels": {"label_accuracy": 1.0}, "tag": {"token_recovery": 0.0, "rouge1": 0.011}}, KNOWS)
    assert wc["attack"] == "tag" and wc["ranking"] == ["tag", "labels"]
    assert worst_case({"labels": {"label_accuracy": 0.75, "seconds": 0.1}}, KNOWS)["region"] == "labels only"
    assert cell_leakage({"seconds": 1.0}) is None  # an attack that measured nothing is no leakage figure


def test_all_blocked_gives_no_attack_and_keys_stay_stable() -> None:
    wc = worst_case({}, KNOWS, {"span": "AEGIS froze the layer"})
    assert wc["attack"] is None and wc["blocked"] == {"span": "AEGIS froze the layer"} and wc["ranking"] == []
    full = worst_case({"presence": {"presence_f1": 0.5}}, KNOWS)
    assert tuple(wc) == tuple(full) == KEYS


def _summary() -> dict:
    util = {
        d: {
            "test_accuracy_mean": acc,
            "test_accuracy_std": 0.0,
            "test_accuracy_values": [acc],
            "train_seconds_mean": 1.0,
        }
        for d, acc in (("none", 0.68), ("aegis", 0.55))
    }
    leak = {
        "none": {"span": {"token_recovery": 1.0, "rouge1": 1.0, "presence_f1": 0.97}, "presence": {"presence_f1": 1.0}},
        "aegis": {"presence": {"presence_f1": 0.011}, "tag": {"token_recovery": 0.206, "rouge1": 0.273}},
    }
    blocked = {"aegis": {"span": "the observation has no gradient for blocks.0.attn.qkv.weight (frozen)"}}
    t = {
        "model": "transformer4",
        "data": "sst2",
        "protocol": "single-step",
        "dropout": 0.0,
        "knowledge": {},
        "samples": 1,
        "utility": util,
        "leakage": leak,
        "skipped": {},
        "blocked": blocked,
        "overhead": {"none": 1.0, "aegis": 1.01},
        "step_seconds": {"none": 0.02, "aegis": 0.02},
        "attacker_knows": KNOWS,
        "worst_case": {d: worst_case(leak[d], KNOWS, blocked.get(d)) for d in util},
    }
    return {"scenario": "t", "seeds": [0], "tasks": {"text": t}, "versions": {"torch": "x"}, "config": {"name": "t"}}


def test_report_leads_each_task_with_the_worst_case_and_shows_blocked_attacks(tmp_path: Path) -> None:
    write_reports(_summary(), tmp_path)
    md = (tmp_path / "report.md").read_text()
    task = md.index("## Task `text`")
    verdict, utility, every = (
        md.index(h, task) for h in ("### Worst case per defense", "### Utility and cost", "### Every attack")
    )
    assert task < verdict < utility < every  # the verdict first, the naive rows after
    rows = md[verdict:utility]
    assert "| none | span | rouge1 1.000 (bag of words); token_recovery 1.000 | naive | — |" in rows
    assert "| aegis | tag | rouge1 0.273 (bag of words); token_recovery 0.206 | naive | span |" in rows
    assert (
        "Blocked: `span` could not run against `aegis`" in md
        and "still worked against `aegis`: `tag`: rouge1 0.273" in md
    )
    html = (tmp_path / "report.html").read_text()
    assert html.index("Worst case per defense") < html.index("Utility and cost") < html.index("Every attack")
    assert (tmp_path / "figures" / "text_privacy_utility.png").is_file()


def test_inf_psnr_is_formatted_and_plotted(tmp_path: Path) -> None:
    s = _summary()
    t = s["tasks"]["text"]
    t["leakage"] = {"none": {"april": {"psnr": math.inf, "ssim": 1.0}}, "aegis": {"april": {"psnr": 8.0, "ssim": 0.4}}}
    t["worst_case"] = {d: worst_case(t["leakage"][d], KNOWS) for d in t["utility"]}
    write_reports(s, tmp_path)
    md = (tmp_path / "report.md").read_text()  # an identical copy reads "exact (∞)", never a bare inf
    assert "| none | april | psnr exact (∞) (whole image); ssim 1.000 | naive |" in md


def test_report_shows_the_examples_it_is_handed_and_reads_no_audit_files(tmp_path: Path) -> None:
    """The report takes the summary and the engine's example records; a stray cell file in the
    folder is not read (the report knows no audit layout)."""
    stray = tmp_path / "cells" / "text" / "none" / "presence" / "seed0.json"
    stray.parent.mkdir(parents=True)
    stray.write_text(json.dumps({"example": {"references": [["stray"]], "reconstructions": [["stray"]]}}))
    example = {"references": [["the", "film", "works"]], "reconstructions": [["the", "film", "fails"]]}
    write_reports(_summary(), tmp_path, {"text": [{"defense": "none", "attack": "span", "example": example}]})
    md = (tmp_path / "report.md").read_text()
    assert "**span against defense none** (wrong tokens struck through)" in md
    assert "- true: the film works" in md and "rebuilt: the film ~~fails~~" in md
    assert "stray" not in md
    write_reports(_summary(), tmp_path)  # no examples handed: no example section, and no error
    assert "the film" not in (tmp_path / "report.md").read_text()


def test_one_identified_image_among_missed_ones_is_a_share_not_an_inf_mean() -> None:
    """Two samples, one identified exactly (inf) and one at 18 dB: the cell reads 59 dB (each
    exact sample counted at 100 dB) with psnr_exact 0.5 beside it, and the headline says so."""
    from veil.attacks.harness import mean_metrics
    from veil.report.headline import leak_line, verdict

    cell = mean_metrics([{"psnr": math.inf, "ssim": 1.0}, {"psnr": 18.0, "ssim": 0.5}])
    assert cell == {"psnr": 59.0, "psnr_exact": 0.5, "ssim": 0.75}
    wc = worst_case({"head-embedding": cell, "ig": {"psnr": 25.0, "ssim": 0.7}}, KNOWS)
    assert (wc["attack"], wc["value"], wc["beside"]["psnr_exact"]) == ("head-embedding", 59.0, 0.5)
    assert "50 % of samples exact" in leak_line(wc) and "inf" not in leak_line(wc)
    assert verdict(wc) == "leaks"


def test_psnr_means_are_unchanged_when_no_sample_or_every_sample_is_exact() -> None:
    from veil.attacks.harness import mean_metrics

    assert mean_metrics([{"psnr": 20.0}, {"psnr": 30.0}]) == {"psnr": 25.0}
    assert mean_metrics([{"psnr": 119.0}, {"psnr": 121.0}]) == {"psnr": 120.0, "psnr_exact": 1.0}
    assert mean_metrics([{"psnr": math.inf}, {"psnr": math.inf}])["psnr"] == math.inf


def test_one_exact_image_of_ten_leaks_though_the_mean_is_low() -> None:
    """1 of 10 images identified exactly, 9 at 10 dB: the mean is 19 dB, the verdict still leaks."""
    from veil.attacks.harness import mean_metrics
    from veil.report.headline import verdict

    cell = mean_metrics([{"psnr": math.inf}] + [{"psnr": 10.0}] * 9)
    assert cell["psnr"] == pytest.approx(19.0) and cell["psnr_exact"] == pytest.approx(0.1)
    assert verdict(worst_case({"head-embedding": cell}, KNOWS)) == "leaks"
    assert verdict(worst_case({"ig": {"psnr": 19.0}}, KNOWS)) != "leaks"  # the same mean with none exact
