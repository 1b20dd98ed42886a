"""scripts/results_seed_claims.py: reads figures from caches / docs sections, says "not measured"
where none holds one, and applies its verdict rules (constructed caches, hand-set numbers)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "results_seed_claims.py"


@pytest.fixture()
def claims(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("results_seed_claims", SCRIPT)
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    mod.DOC, mod.RUNS = tmp_path / "results.md", tmp_path / "runs"
    mod.DOC.write_text("# veil results\n")
    return mod


def test_nothing_cached_is_not_measured_and_open(claims: ModuleType, tmp_path: Path) -> None:
    md = claims.render(tmp_path / "no_audit")
    rows = [line for line in md.splitlines() if line.startswith("| ") and not line.startswith("| paper")]
    assert len(rows) == 6
    for line in rows:
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[2] == cells[3] == "not measured" and cells[4] == "**open**", line


def test_tables_reads_a_markdown_table(claims: ModuleType) -> None:
    text = "intro\n\n| a | b c |\n|---|---|\n| 1 | x |\n| 2 | y |\n\nafter\n"
    assert claims.tables(text) == [[{"a": "1", "b c": "x"}, {"a": "2", "b c": "y"}]]
    assert claims.num("97.3 dB") == 97.3 and claims.num("—") is None


def test_pfesta_is_refuted_when_unshuffling_restores_the_inversion(claims: ModuleType) -> None:
    (claims.RUNS / "results").mkdir(parents=True)
    cell = lambda plain, perm: {"plain": {"psnr": plain}, "permuted": {"psnr": perm}}  # noqa: E731
    path = claims.RUNS / "results" / "features.json"
    path.write_text(
        json.dumps({"feature_inversion": cell(25.5, 10.0), "feature_inversion+unshuffle": cell(25.5, 25.2)})
    )
    row = claims.pfesta()
    assert row["verdict"] == "refuted" and "25.2 dB" in row["adaptive"] and "10.0 dB permuted" in row["naive"]
    path.write_text(
        json.dumps({"feature_inversion": cell(25.5, 10.0), "feature_inversion+unshuffle": cell(25.5, 11.0)})
    )
    assert claims.pfesta()["verdict"] == "confirmed"  # the adaptive attacker did no better than the naive one


def test_mjp_images_read_the_adaptive_image_cache(claims: ModuleType) -> None:
    (claims.RUNS / "adaptive_image").mkdir(parents=True)
    cache = {
        "april": {"mean": {"psnr": 10.4}},
        "april-mjp": {"mean": {"psnr": 25.0, "psnr_unshuffled": 86.0, "psnr_masked_set": 40.0}},
    }
    (claims.RUNS / "adaptive_image" / "digits_init_g0.27_n8.json").write_text(json.dumps(cache))
    row = claims.mjp_images(None)
    assert row["verdict"] == "refuted"
    assert (
        "unshuffled patches 86.0 dB, masked set 40.0 dB, whole image 25.0 dB (`april` on the same updates: 10.4 dB"
        in row["adaptive"]
    )


@pytest.mark.parametrize(
    "bag, tok, verdict", [(0.96, 0.8, "refuted"), (0.2, 0.1, "partly"), (0.01, 0.0, "confirmed"), (None, None, "open")]
)
def test_text_verdict_rule(claims: ModuleType, bag: float | None, tok: float | None, verdict: str) -> None:
    assert claims.text_verdict(bag, tok) == verdict


def test_image_verdict_rule(claims: ModuleType) -> None:
    assert claims.image_verdict(97.0, 11.52) == "refuted"
    assert claims.image_verdict(13.0, 11.52) == "confirmed"
    assert claims.image_verdict(20.0, 11.52) == "partly"


def test_mjp_text_reads_the_adaptive_text_cache(claims: ModuleType) -> None:
    (claims.RUNS / "adaptive_text").mkdir(parents=True)
    figs = lambda r, b, t: {"rouge1": r, "bag_recall": b, "token_recovery": t, "unshuffled_recovery": 1.0}  # noqa: E731
    (claims.RUNS / "adaptive_text" / "init_span_16.json").write_text(json.dumps(figs(0.67, 0.5, 0.48)))
    (claims.RUNS / "adaptive_text" / "init_span-mjp_16.json").write_text(json.dumps(figs(1.0, 1.0, 0.82)))
    row = claims.mjp_text(None)
    assert "span, init: ROUGE-1 0.67" in row["naive"] and "`span-mjp`, init: ROUGE-1 1.00" in row["adaptive"]
    assert row["verdict"] == "refuted"


def test_dropout_row_reads_the_span_robust_cache(claims: ModuleType) -> None:
    (claims.RUNS / "span_robust").mkdir(parents=True)

    def cell(naive, robust):
        return {
            "span": {"mean": {"token_recovery": naive}},
            "span-robust": {"mean": {"token_recovery": robust}},
        }  # noqa: E731

    (claims.RUNS / "span_robust" / "minilm_b1_t32_p0.1_n8.json").write_text(json.dumps(cell(0.0, 0.95)))
    (claims.RUNS / "span_robust" / "minilm_b4_t32_p0.1_n8.json").write_text(json.dumps(cell(0.0, 0.6)))
    row = claims.dropout()
    assert row["naive"].endswith("token recovery 0.000") and "0.95 at batch 1, 0.60 at batch 4" in row["adaptive"]
    assert row["verdict"] == "refuted"


def test_aegis_is_partly_when_one_model_leaks_and_another_does_not(claims: ModuleType) -> None:
    claims.DOC.write_text(
        "<!-- aegis:start -->\n| model | defense | attack | presence F1 (random, same guesses) | token recovery | note |\n|---|---|---|---|---|---|\n"
        "| transformer4 | aegis | presence | 0.003 (0.0026) | - | x |\n| transformer4 | aegis | span | 0 | 0 | blocked: frozen |\n<!-- aegis:end -->\n"
        "<!-- aegis-tag:start -->\n| task | defense | test accuracy (%) | TAG token recovery |\n|---|---|---|---|\n"
        "| sst2-text (transformer4) | aegis | 54.6 | 0.250 |\n| sst2-minilm (minilm) | aegis(lr_scale=3.0) | 79.8 | 0.000 |\n<!-- aegis-tag:end -->\n"
    )
    row = claims.aegis(None)
    assert "span blocked" in row["naive"] and "0.250 on transformer4, 0.000 on MiniLM" in row["adaptive"]
    assert row["verdict"] == "partly"
