"""MJP Fig. 9 analogue (`veil analyze tokens`): recovered vs original token embeddings in 2-D PCA
and their cosine. An exact reconstruction scores 1, a wrong one less, and the figure is drawn."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from veil.analysis import tokens
from veil.attacks.base import Reconstruction
from veil.attacks.harness import private_batches


def test_projection_of_identical_sets_has_cosine_one_and_a_moved_set_less() -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(20, 8))
    p, q, var = tokens.project_2d(x, x.copy())
    assert p.shape == (20, 2) and np.allclose(p, q) and tokens.cosine(p, q) == pytest.approx(1.0)
    assert var[0] >= var[1] > 0
    p, q, _ = tokens.project_2d(x, x[::-1].copy())
    assert tokens.cosine(p, q) < 0.9
    assert tokens.rowwise_cosine(x, x) == pytest.approx(1.0)
    assert tokens.cosine(np.zeros(4), np.ones(4)) == 0.0


class _Oracle:
    """An 'attack' that returns given sequences (the truth, or a corruption of it)."""

    observes = frozenset({"gradient"})

    def __init__(self, seqs: list[list[int]]) -> None:
        self.seqs = list(seqs)

    def reconstruct(self, obs, know) -> Reconstruction:  # noqa: ANN001
        return Reconstruction(token_ids=[self.seqs.pop(0)])


@pytest.fixture(scope="module")
def text_run():  # noqa: ANN201
    from veil.data import load_data
    from veil.models import create_model

    data = load_data("sst2", tokenizer="word", max_len=12, train_size=60, test_size=6)
    torch.manual_seed(0)
    model = create_model("transformer4", vocab_size=data.meta["vocab_size"], max_len=12, dim=32, depth=1)
    return model, data


def _truth(data, samples: int) -> list[list[int]]:  # noqa: ANN001
    return [
        b["input_ids"][0][b["attention_mask"][0].bool()].tolist() for b in private_batches(data.test, 1, samples, 0)
    ]


def test_an_exact_reconstruction_scores_cosine_one_and_a_wrong_one_less(
    text_run, monkeypatch: pytest.MonkeyPatch
) -> None:  # noqa: ANN001
    model, data = text_run
    truth = _truth(data, 3)
    monkeypatch.setattr(tokens, "create_attack", lambda name, **kw: _Oracle(truth))
    exact = tokens.recovered_embeddings(model, data, [], "oracle", samples=3)
    assert exact["cosine_2d"] == pytest.approx(1.0) and exact["cosine_full"] == pytest.approx(1.0)
    assert exact["token_recovery"] == pytest.approx(1.0)
    special = set(data.meta["special_ids"])
    assert exact["tokens"] == sum(len([i for i in s if i not in special]) for s in truth)
    wrong = [[s[0], *reversed(s[1:-1]), s[-1]] for s in truth]  # content in reverse order
    monkeypatch.setattr(tokens, "create_attack", lambda name, **kw: _Oracle(wrong))
    rev = tokens.recovered_embeddings(model, data, [], "oracle", samples=3)
    assert rev["cosine_full"] < 0.9 and rev["cosine_2d"] < exact["cosine_2d"]
    assert len(rev["points"]["original"]) == len(rev["points"]["recovered"]) == rev["tokens"]


def test_tag_runs_through_it_and_the_figure_is_drawn(text_run, tmp_path: Path) -> None:  # noqa: ANN001
    from veil.report.token_pca import token_pca_figure

    model, data = text_run
    out = tokens.recovered_embeddings(model, data, [], "tag", {"iterations": 3}, samples=2, grant={"labels": True})
    assert -1.0 <= out["cosine_2d"] <= 1.0 and out["tokens"] > 0
    path = token_pca_figure([{"label": "none", **out}, {"label": "again", **out}], tmp_path / "f.png", "t")
    assert path.is_file() and path.stat().st_size > 5000


def test_the_fig9_section_lists_each_model_and_links_the_figure() -> None:
    from results.sections import mjp_fig9

    panel = {
        "label": "mjp(gamma=0.5,window=8)",
        "tokens": 40,
        "cosine_2d": 0.25,
        "cosine_full": 0.1,
        "token_recovery": 0.05,
    }
    summary = {
        "settings": {"attack": "tag", "iterations": 300, "samples": 4},
        "tasks": {"fig9": {"figure": "token_pca.png", "figure_doc": "figures/mjp-fig9-tokens_token_pca.png"}},
        "panels": [panel],
    }
    text = mjp_fig9.render(summary)
    assert "| mjp(gamma=0.5,window=8) | 40 | 0.250 | 0.100 | 0.050 |" in text
    assert "(figures/mjp-fig9-tokens_token_pca.png)" in text and "tag (300 iterations" in text
    assert "not protection" in text  # the stronger attacker is named
