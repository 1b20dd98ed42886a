"""docs/results.md is rendered from collected audit summaries (`results`): one section
renders to a hand-written expectation, the repository's document is what its caches render, a
collected summary is hashed and a damaged one refused, and rewriting keeps every other section."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from results import all_sections, cache_of, collect, load, render_doc, splice
from results.__main__ import main
from results.sections import budgets, span_robust
from veil.errors import VeilError
from veil.io import write_checked_text

#: the repository's document (the tool takes it as an argument; the tests do not depend on the current folder)
DOC = Path(__file__).resolve().parents[1] / "docs" / "results.md"


def _summary() -> dict:
    """A two-task span-robust summary, as the engine writes it (only the keys the section reads)."""
    task = {"name": "minilm-b1", "run": {"data": {"max_len": 32}}}
    other = {"name": "gpt-tiny-b2", "run": {"data": {"max_len": 16}}}
    leak = {
        "span-robust": {
            "token_recovery": 0.9,
            "rouge1": 0.95,
            "presence_f1": 1.0,
            "exact_recovery": 0.5,
            "seconds": 4.24,
        },
        "span": {"token_recovery": 0.0, "rouge1": 0.0, "presence_f1": 0.0, "exact_recovery": 0.0, "seconds": 0.06},
    }
    entry = {"model": "minilm", "dropout": 0.1, "knowledge": {"batch_size": 1}, "samples": 8, "leakage": {"none": leak}}
    gpt = {**entry, "model": "gpt-tiny", "knowledge": {"batch_size": 2}}
    budget = {"none": {"span": {"budget_used": 0.25, "budget_used_max": 1.25, "budget_stopped": 1.0}}}
    gpt["budget"] = budget
    return {
        "scenario": "span-robust",
        "config": {"tasks": [task, other]},
        "tasks": {"minilm-b1": entry, "gpt-tiny-b2": gpt},
        "over_budget": ["gpt-tiny-b2 / none / span: budget_used 1.250"],
    }


EXPECTED = """### Span attack under client dropout (`span-robust`), SST-2, 8 updates per cell

| model (width) | batch | max_len | client dropout | attack | token_recovery | ROUGE-1 | presence F1 | exact | s/update | goal |
|---|---|---|---|---|---|---|---|---|---|---|
| minilm (384) | 1 | 32 | 0.1 | span-robust | 0.900 | 0.950 | 1.000 | 0.50 | 4.2 | ≥ 0.8 met |
| minilm (384) | 1 | 32 | 0.1 | span | 0.000 | 0.000 | 0.000 | 0.00 | 0.1 | reported |
| gpt-tiny (128) | 2 | 16 | 0.1 | span-robust | 0.900 | 0.950 | 1.000 | 0.50 | 4.2 | reported |
| gpt-tiny (128) | 2 | 16 | 0.1 | span | 0.000 | 0.000 | 0.000 | 0.00 | 0.1 | reported |"""


def test_a_section_renders_its_summary_as_written_by_hand() -> None:
    text = span_robust.render(_summary())
    assert text.split("\n\nRegenerated")[0] == EXPECTED
    assert "`span`'s 0.000 under dropout is its exact check failing, not protection" in text


def test_the_budget_section_names_every_cell_and_the_ones_over_budget() -> None:
    text = budgets.render({"span-robust": _summary(), "empty": {"tasks": {}, "over_budget": []}})
    assert "| span-robust | gpt-tiny-b2 | none | span | 0.250 | 1.250 | yes |" in text
    assert "Over budget (> 1.2x): span-robust: gpt-tiny-b2 / none / span: budget_used 1.250." in text
    assert "No budgeted cell in: empty." in text


def test_docs_results_md_is_what_its_cached_summaries_render(capsys) -> None:
    rc = main(["--check", "--docs", str(DOC)])  # `python -m results --check`, run from the repository root
    diff = capsys.readouterr().out
    assert rc == 0 and diff == "", f"docs/results.md differs from its rendering (python -m results):\n{diff[:3000]}"


def test_the_book_reads_and_writes_only_beside_the_document_it_is_given(tmp_path: Path, capsys) -> None:
    assert cache_of(DOC) == DOC.parent / "results" and cache_of(tmp_path / "r.md") == tmp_path / "results"
    assert main(["--check", "--docs", str(tmp_path / "missing.md")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("veil: no results document at") and "--docs PATH" in err and "\n" not in err


def test_collect_hashes_the_summary_and_a_damaged_cache_is_refused(tmp_path: Path, capsys) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({**_summary(), "versions": {"torch": "x"}}))
    dest = collect(run, None, tmp_path / "cache")
    assert dest.name == "span-robust.json" and dest.with_name(dest.name + ".sha256").is_file()
    assert "versions" not in load("span-robust", tmp_path / "cache")  # what no section renders is dropped
    doc = tmp_path / "results.md"
    doc.write_text(
        "# r\n\n<!-- other:start -->\nkept as is\n<!-- other:end -->\n\n<!-- span-robust:start -->\nold\n<!-- span-robust:end -->\n"
    )
    new, done = render_doc(doc.read_text(), tmp_path / "cache")
    assert "span-robust" in done and "budgets" in done
    assert "kept as is" in new and "old" not in new and EXPECTED in new
    assert main(["--check", "--doc", str(doc), "--cache", str(tmp_path / "cache")]) == 1
    assert "+| minilm (384) | 1 | 32" in capsys.readouterr().out
    dest.write_text(dest.read_text().replace("0.9", "0.1"))
    with pytest.raises(VeilError, match="does not match its recorded hash"):
        load("span-robust", tmp_path / "cache")
    assert main(["collect", str(tmp_path / "nothing"), "--docs", str(DOC)]) == 2
    assert "holds no summary.json" in capsys.readouterr().err


def test_splice_replaces_only_its_own_markers_and_appends_a_new_one() -> None:
    text = "a\n<!-- x:start -->\nold\n<!-- x:end -->\nb\n"
    assert splice(text, "x", "new") == "a\n<!-- x:start -->\nnew\n<!-- x:end -->\nb\n"
    assert splice(text, "y", "more").endswith("<!-- y:start -->\nmore\n<!-- y:end -->\n")


def test_every_section_module_renders_a_marker_of_the_document() -> None:
    text = DOC.read_text()
    for s in all_sections():
        assert f"<!-- {s.name}:start -->" in text and callable(s.module.render), s.name


def test_the_utility_section_reports_each_defense_against_undefended() -> None:
    from results.sections import utility

    u = {
        "none": {"test_accuracy_values": [0.86, 0.87, 0.85]},
        "aegis": {"test_accuracy_values": [0.84, 0.85, 0.85]},
    }
    lm = {"none": {"test_accuracy_values": [0.17], "test_perplexity_values": [598.04]}}
    main = {
        "seeds": [0, 1, 2],
        "tasks": {
            "sst2-minilm": {"model": "minilm", "utility": u, "overhead": {"none": 1.0, "aegis": 0.954}},
            "agnews-gpt2": {"model": "hf-gpt2", "utility": lm},
        },
    }
    text = utility.render({"minilm-utility": main})
    assert "| sst2-minilm (minilm) | none | 3 | 86.00 ± 0.82 | — | — | — | — | 1.00 |" in text
    assert "| sst2-minilm (minilm) | aegis | 3 | 84.67 ± 0.47 | -1.33 | 0.67 | no | — | 0.95 |" in text
    assert "| agnews-gpt2 (hf-gpt2) | none | 1 | 17.00 ± 0.00 | — | — | — | 598.0 ± 0.0 | — |" in text
    assert f"| sst2-minilm (minilm) | {utility.DP_LABEL} | 0 | not collected yet" in text
    dp = {
        "sst2-minilm": {"model": "minilm", "utility": {utility.DP_LABEL: {"test_accuracy_values": [0.80, 0.82, 0.81]}}}
    }
    dp["sst2-minilm"]["overhead"] = {utility.DP_LABEL: 2.5}
    both = utility.render({"minilm-utility": main, "minilm-utility-dp": {"seeds": [0, 1, 2], "tasks": dp}})
    assert f"| sst2-minilm (minilm) | {utility.DP_LABEL} | 3 | 81.00 ± 0.82 | -5.00 | 0.82 | no | — | 2.50 |" in both
    assert "not collected" not in both and main["tasks"]["sst2-minilm"]["utility"] == u  # the inputs stay as they were


def test_a_section_renders_without_a_missing_optional_source(tmp_path: Path) -> None:
    from results import Section, render_section
    from results.sections import utility

    assert render_section(Section("utility", utility), tmp_path) is None  # its required source is missing
    lm = {"none": {"test_accuracy_values": [0.17], "test_perplexity_values": [598.04]}}
    collect_json = {"seeds": [0], "tasks": {"agnews-gpt2": {"model": "hf-gpt2", "utility": lm}}}
    write_checked_text(tmp_path / "minilm-utility.json", json.dumps(collect_json))
    text = render_section(Section("utility", utility), tmp_path)
    assert text is not None and "| agnews-gpt2 (hf-gpt2) | none | 1 |" in text and "not collected yet" in text


def test_collect_copies_a_tasks_own_figure_beside_the_document(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "figures").mkdir(parents=True)
    (run / "figures" / "t_rounds.png").write_bytes(b"png")
    (run / "summary.json").write_text(
        json.dumps({"scenario": "fed", "tasks": {"t": {"figure": "figures/t_rounds.png"}}})
    )
    collect(run, None, tmp_path / "results", tmp_path / "figures")
    assert (tmp_path / "figures" / "fed_t_rounds.png").read_bytes() == b"png"
    assert load("fed", tmp_path / "results")["tasks"]["t"]["figure_doc"] == "figures/fed_t_rounds.png"


def test_the_mjp_section_renders_each_table_from_its_scenario() -> None:
    from results.sections import mjp

    def u(*accs: float, **ev: dict) -> dict:
        return {"test_accuracy_values": list(accs), "test_accuracy_mean": sum(accs) / len(accs), **ev}

    shuffle = {"0": 0.9, "0.27": 0.6}
    t1 = {
        "seeds": [0, 1],
        "tasks": {
            "digits": {
                "utility": {
                    "none": u(0.9, 0.92, evaluations={"test_shuffle": shuffle}),
                    "mjp(aux=dal,gamma=0.1)": u(0.9, 0.9, evaluations={"test_shuffle": {"0": 0.9, "0.27": 0.8}}),
                }
            }
        },
    }
    t2 = {"seeds": [0], "tasks": {"digits": {"utility": {"none": u(0.9), "mjp(aux=dal,gamma=0.27)": u(0.85)}}}}
    t45 = {"seeds": [0], "tasks": {"sst2-transformer4": {"utility": {"none": u(0.7, evaluations={"pe": {"1": 5.0}})}}}}
    t6 = {"seeds": [0], "tasks": {"sst2-window": {"utility": {"mjp(gamma=0.5,window=4)": u(0.7)}}}}
    t12 = {"seeds": [0], "tasks": {"digits": {"utility": {"none": u(0.9, evaluations={"pe": {"1": 36.4}})}}}}
    text = mjp.render({"mjp-table1": t1, "mjp-table2": t2, "mjp-tables4-5": t45, "mjp-table6": t6, "mjp-table12": t12})
    assert "| ViT (vit-digits) on digits | mjp(aux=dal,gamma=0.1) | 91.00 ± 1.00 | 90.00 ± 0.00 | -1.00 | yes |" in text
    assert "| mjp | 90.00 ± 0.00 | 85.00 ± 0.00 |" in text  # gamma 0, 0.27
    assert "| none | 90.00 | 60.00 | 30.00 |" in text and "met (10.00 vs 30.00 points)" in text
    assert "| mjp | 70.00 ± 0.00 |" in text
    assert "| ViT (vit-digits) on digits, none | 36.40 |" in text and "| Transformer4 on SST-2, none | 5.00 |" in text


def test_within_points_is_hand_computed_and_exactly_n_points_is_within() -> None:
    from results.tables import within_points

    assert within_points([0.49], [0.50], 1.0) == ["-1.00", "yes"]  # 100 * (0.49 - 0.50) = -1.0000000000000009
    assert within_points([0.485], [0.50], 1.0) == ["-1.50", "**no**"]
    assert within_points([0.70, 0.72], [0.68], 3.0) == ["+3.00", "yes"]
    assert within_points([0.62], [0.68], 3.0) == ["-6.00", "**no**"]


def test_the_span_signal_table_leaves_out_the_cls_only_last_block() -> None:
    from results.sections.span_scale import signal

    row = {"batch": 16, "tokens": 420, "ranks": [383, 383, 16], "width": 1536}
    row["median_distance"] = {"0": [0.0441, 0.0766, 0.86], "1": [0.0881, 0.1409, 0.88]}
    text = signal({"model": "minilm", "command": "python benchmarks/span_scale.py --signal 16", "batches": [row]})
    assert (
        "| 16 | 420 | 383 / 383 / 16 | 0 | 0.044 | 0.077 |" in text
        and "| 16 | 420 | 383 / 383 / 16 | 1 | 0.088 | 0.141 |" in text
    )
    assert "block 3" not in text and "0.860" not in text
