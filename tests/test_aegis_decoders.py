"""The results sections of AEGIS on decoders (issue 19): the perplexity gap against the undefended
run with the 10 % goal, and the LLaMA attack table with refusals listed beside the attacks that ran."""

from __future__ import annotations


def _task(util: dict, leakage: dict, blocked: dict | None = None) -> dict:
    return {
        "model": "llama-tiny",
        "data": "sst2-val",
        "samples": 2,
        "knowledge": {"batch_size": 2},
        "utility": util,
        "leakage": leakage,
        "blocked": blocked or {},
        "skipped": {},
    }


def test_the_recipe_table_gives_each_defense_its_gap_and_the_10_percent_verdict() -> None:
    from results.sections import aegis_recipe

    util = {
        "none": {"test_perplexity_mean": 500.0, "test_accuracy_mean": 0.1},
        "aegis": {"test_perplexity_mean": 1000.0, "test_accuracy_mean": 0.05},
        "aegis(noised_lr=0.1)": {"test_perplexity_mean": 540.0, "test_accuracy_mean": 0.09},
    }
    leak = {"aegis": {"presence": {"presence_f1": 0.01}}, "none": {"presence": {"presence_f1": 1.0}}}
    summary = {
        "seeds": [0],
        "tasks": {"t": _task(util, leak)},
        "config": {"tasks": [{"name": "t", "defenses": ["none", "aegis", {"name": "aegis", "noised_lr": 0.1}]}]},
    }
    text = aegis_recipe.render(summary)
    assert "| none | undefended | 500.0 | — | — | 1.000 | — |" in text
    assert "| aegis | veil's causal-LM default" in text and "| 1000.0 | +100.0 % | **no** | 0.010 | — |" in text
    assert "| 540.0 | +8.0 % | yes |" in text


def test_the_llama_table_lists_refusals_in_the_undefended_row_and_the_rope_note() -> None:
    from results.sections import aegis_llama

    util = {
        "none": {"test_perplexity_mean": 544.6, "test_accuracy_mean": 0.0946},
        "aegis": {"test_perplexity_mean": 2232.2, "test_accuracy_mean": 0.0627},
    }
    leak = {
        "none": {"presence": {"presence_f1": 1.0, "presence_recall": 1.0}},
        "aegis": {"presence": {"presence_f1": 0.0}},
    }
    blocked = {
        "none": {
            "span": "model llama has no position table (RoPE rotates queries and keys instead); attacks and defenses that read E_pos do not apply to it"
        }
    }
    summary = {
        "seeds": [0],
        "tasks": {"t": _task(util, leak, blocked)},
        "config": {"tasks": [{"name": "t", "defenses": ["none", "aegis"]}]},
    }
    text = aegis_llama.render(summary)
    assert "| none | 544.6 | 9.46 |" in text and "| aegis | 2232.2 | 6.27 |" in text
    assert "| none | presence | 1.000 | 1.000 | — | — | — |" in text
    assert "| none | span | — | — | — | — | model llama has no position table" in text
    assert "shrink to |V|" in text and "not protection" in text
