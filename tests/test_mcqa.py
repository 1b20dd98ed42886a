"""The offline multiple-choice QA task (MJP Table VII analogue) and its model: how items are
built, the pair encoding, and a scorer that is equivariant to the order of the choices."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import MC_TEXTS
from veil.data.multiple_choice import build_split, draw_choices, encode_pairs, split_halves
from veil.data.tokenizers import WordTokenizer
from veil.errors import VeilError

TEXTS = MC_TEXTS


@pytest.fixture(scope="module")
def tok() -> WordTokenizer:
    return WordTokenizer.build(TEXTS)


def test_items_are_a_text_cut_in_half_and_distractors_of_the_same_length(tok: WordTokenizer) -> None:
    split, items = build_split(TEXTS, tok, choices=4, max_len=32, min_words=8, seed=0)
    assert len(items) == len(TEXTS) - 1  # "too short" is dropped
    ctx, end = split_halves(TEXTS, 8)
    for item, c, e in zip(items, ctx, end):
        assert item["context"] == c and item["endings"][item["label"]] == e  # the true second half
        assert len(set(item["endings"])) == 4  # three other texts' endings
        assert all(x in end for x in item["endings"])
        original = next(t for t in TEXTS if t.startswith(c))
        assert original == f"{c} {e}"
    assert split["input_ids"].shape == (8, 4, 32) and split["labels"].shape == (8,)
    assert split["labels"].tolist() == [it["label"] for it in items]
    again, _ = build_split(TEXTS, tok, choices=4, max_len=32, min_words=8, seed=0)
    other, _ = build_split(TEXTS, tok, choices=4, max_len=32, min_words=8, seed=1)
    assert torch.equal(again["input_ids"], split["input_ids"])  # a fixed seed, a fixed data set
    assert not torch.equal(other["input_ids"], split["input_ids"])


def test_distractors_match_the_true_endings_word_count_when_they_can() -> None:
    endings = [" ".join(["w"] * n) for n in (3, 3, 3, 3, 5, 5, 5, 5, 5, 9)]
    picks, labels = draw_choices(endings, 4, seed=0)
    lengths = np.array([len(e.split()) for e in endings])
    for i in range(9):  # every length but 9 has >= 4 texts: all four choices have the same length
        assert picks[i, labels[i]] == i and len(set(picks[i])) == 4
        assert (lengths[picks[i]] == lengths[i]).all()
    assert picks[9, labels[9]] == 9 and len(set(picks[9])) == 4  # the odd one out: nearest lengths
    assert set(np.bincount(labels, minlength=4).nonzero()[0]) == {0, 1, 2, 3} or len(labels) < 8


def test_a_pair_is_cls_context_sep_ending_sep_with_token_types() -> None:
    tok = WordTokenizer.build(["a b c d e f g h", "x y z"])
    enc = encode_pairs(tok, ["a b c d e f g h"], ["x y z"], np.array([[0, 0]]), max_len=10)
    ids, mask, types = enc["input_ids"][0], enc["attention_mask"][0], enc["token_type_ids"][0]
    assert ids[0] == tok.cls_id and int(mask.sum()) == 10
    seps = (ids == tok.sep_id).nonzero().flatten().tolist()
    assert seps[-1] == 9 and len(seps) == 2
    words = tok.decode(ids)
    assert words[seps[0] + 1 : 9] == ["x", "y", "z"]  # the ending kept whole
    assert words[1 : seps[0]] == ["e", "f", "g", "h"]  # the context keeps its end
    assert types.tolist() == [0] * (seps[0] + 1) + [1] * (10 - seps[0] - 1)


def test_too_few_texts_and_a_bad_source_are_one_line() -> None:
    from veil.data.multiple_choice import mcqa

    with pytest.raises(VeilError, match="at least 4 texts"):
        draw_choices(["a b", "c d", "e f"], 4, seed=0)
    with pytest.raises(VeilError, match="source must be one of: agnews, sst2"):
        mcqa(source="yelp")


def _model(choices: int = 4):  # noqa: ANN202
    from veil.models import create_model

    return create_model("transformer4-mc", vocab_size=128, max_len=16, num_classes=choices, dim=32, depth=2)


def _batch(b: int = 3, c: int = 4, t: int = 12) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 100, (b, c, t), generator=g)
    ids[..., 0], ids[..., 5], ids[..., 9] = 101, 102, 102  # [CLS] ctx [SEP] ending [SEP]
    mask = torch.ones(b, c, t, dtype=torch.int64)
    mask[..., 10:] = 0
    types = torch.zeros(b, c, t, dtype=torch.int64)
    types[..., 6:10] = 1
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": types, "labels": torch.tensor([0, 1, 3])}


def test_the_model_scores_each_choice_and_permuting_choices_permutes_the_scores() -> None:
    model = _model().eval()
    batch = _batch()
    logits = model(batch)
    assert logits.shape == (3, 4)
    perm = torch.tensor([2, 0, 3, 1])
    moved = {k: (v[:, perm] if v.dim() == 3 else v) for k, v in batch.items()}
    assert torch.allclose(model(moved), logits[:, perm], atol=1e-5)
    # each score depends on its own pair only
    other = {k: v.clone() for k, v in batch.items()}
    other["input_ids"][:, 1, 2] = 7
    changed = model(other) != logits
    assert changed[:, 1].all() and not changed[:, [0, 2, 3]].any()
    loss = model.loss(logits, batch)
    assert torch.isclose(loss, torch.nn.functional.cross_entropy(logits, batch["labels"]))


def test_mjp_shuffles_inside_each_pair_and_keeps_cls_and_both_seps() -> None:
    from veil.defenses import create_defense

    model = _model()
    mjp = create_defense("mjp", gamma=0.5, window=None)
    mjp.attach(model)
    model.train()
    batch = _batch()
    model(batch)
    st = mjp.last
    assert st.mask.shape == (12, 12)  # (batch * choices, length)
    flat = batch["input_ids"].reshape(12, 12)
    assert not st.mask[:, [0, 5, 9]].any() and not st.mask[:, 10:].any()
    assert st.mask.sum(1).min() >= 2  # every pair shuffled
    assert torch.equal(torch.gather(flat, 1, st.perm).sort(1).values, flat.sort(1).values)


def test_a_single_sequence_batch_is_refused_in_one_line() -> None:
    model = _model()
    with pytest.raises(VeilError, match=r"input_ids of shape \(batch, choices, length\)"):
        model({"input_ids": torch.ones(2, 8, dtype=torch.int64), "attention_mask": torch.ones(2, 8, dtype=torch.int64)})
    with pytest.raises(VeilError, match="scores 4 choices but the batch has 3"):
        model(_batch(c=3))


def test_the_table7_section_reports_each_gamma_against_undefended() -> None:
    from results.sections import mjp_table7

    util = {
        "none": {"test_accuracy_values": [0.50]},
        "mjp(gamma=0.5,window=32)": {"test_accuracy_values": [0.485]},
        "mjp(gamma=0.1,window=32)": {"test_accuracy_values": [0.505]},
        "mjp(gamma=0.3,window=32)": {"test_accuracy_values": [0.49]},  # exactly 1 point below, a hair more in floats
    }
    entries = ["none", {"name": "mjp", "gamma": 0.5, "window": 32}, {"name": "mjp", "gamma": 0.1, "window": 32}]
    entries.append({"name": "mjp", "gamma": 0.3, "window": 32})
    summary = {
        "seeds": [0],
        "tasks": {"t": {"utility": util}},
        "config": {"tasks": [{"name": "t", "run": {"data": {"max_len": 40, "train_size": 2000}}, "defenses": entries}]},
    }
    text = mjp_table7.render(summary)
    lines = [x for x in text.splitlines() if x.startswith("| ")]
    assert lines[1] == "| 0.0 (none) | none | 1 | 50.00 ± 0.00 | 25.0 | +25.00 | — | — |"
    assert lines[2] == "| 0.1 | mjp(gamma=0.1,window=32) | 1 | 50.50 ± 0.00 | 25.0 | +25.50 | +0.50 | yes |"  # by gamma
    assert lines[3] == "| 0.3 | mjp(gamma=0.3,window=32) | 1 | 49.00 ± 0.00 | 25.0 | +24.00 | -1.00 | yes |"
    assert lines[4] == "| 0.5 | mjp(gamma=0.5,window=32) | 1 | 48.50 ± 0.00 | 25.0 | +23.50 | -1.50 | **no** |"
    assert "2,000 training items" in text and "(40 tokens" in text
    assert "largest drop under MJP is 1.50 points; gamma 0.5 misses the 1-point goal" in text
    util["none"]["test_accuracy_values"] = [0.26]  # an undefended model at chance: the gaps mean nothing
    assert "stays near chance here (26.0 %)" in mjp_table7.render(summary)
