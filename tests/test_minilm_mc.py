"""minilm-mc: the pretrained MiniLM-L6 with a multiple-choice head (MJP Table VII analogue): the
pretrained weights are the ones loaded, each (context, ending) pair gets one score, and MJP at
gamma 0 trains it bit-identically to no defense."""

from __future__ import annotations

import copy

import pytest
import torch

from helpers import MC_TEXTS
from veil.data.multiple_choice import build_split
from veil.data.tokenizers import make_tokenizer
from veil.defenses.mjp import MJP
from veil.models import create_model
from veil.models.multiple_choice import MultipleChoiceMiniLM
from veil.training.step import client_step

TEXTS = MC_TEXTS[:6]  # the first six: every one long enough


@pytest.fixture(scope="module")
def base() -> MultipleChoiceMiniLM:
    torch.manual_seed(0)
    return create_model("minilm-mc")


@pytest.fixture(scope="module")
def batch() -> dict[str, torch.Tensor]:
    """Real mcqa items: the texts cut in half, WordPiece pairs of 24 tokens, (6, 4, 24)."""
    split, _ = build_split(TEXTS, make_tokenizer("wordpiece"), choices=4, max_len=24, min_words=8, seed=0)
    return split


def test_it_is_the_pretrained_minilm_with_one_score_per_pair(base: MultipleChoiceMiniLM, batch: dict) -> None:
    plain = create_model("minilm")
    ours = dict(base.hf.bert.named_parameters())
    for k, v in plain.hf.bert.named_parameters():  # the encoder and pooler: MiniLM's own weights
        assert torch.equal(ours[k], v), k
    assert base.hf.classifier.weight.shape == (1, 384)  # a fresh linear scorer on the pooled output
    assert base.position_table() is base.hf.bert.embeddings.position_embeddings.weight  # MiniLM's absolute table
    assert base.max_positions() == 512 and base.choices == 4
    model = copy.deepcopy(base).eval()
    logits = model(batch)
    assert logits.shape == (6, 4)
    flat = {k: v.reshape(24, -1) for k, v in batch.items() if k != "labels"}
    pooled = model.hf.bert(**flat).pooler_output  # Hugging Face's own forward on the 24 pairs
    torch.testing.assert_close(logits, model.hf.classifier(pooled).view(6, 4), rtol=1e-5, atol=1e-5)
    perm = torch.tensor([3, 1, 0, 2])
    moved = {k: (v[:, perm] if v.dim() == 3 else v) for k, v in batch.items()}
    torch.testing.assert_close(model(moved), logits[:, perm], rtol=1e-5, atol=1e-5)
    loss = model.loss(logits, batch)
    assert torch.isclose(loss, torch.nn.functional.cross_entropy(logits, batch["labels"]))


def test_mjp_gamma_zero_trains_it_bit_identically_to_none(base: MultipleChoiceMiniLM, batch: dict) -> None:
    plain, defended = copy.deepcopy(base).train(), copy.deepcopy(base).train()
    d = MJP(gamma=0.0, window=32).attach(defended)  # text: aux none by default
    opt_a = torch.optim.AdamW(plain.parameters(), lr=1e-4)
    opt_b = torch.optim.AdamW([p for n, p in defended.named_parameters() if not n.startswith("mjp.")], lr=1e-4)
    for step in range(2):  # dropout on: the same seed draws the same masks in both
        torch.manual_seed(step)
        ra = client_step(plain, batch, [], optimizer=opt_a, step=step)
        torch.manual_seed(step)
        rb = client_step(defended, batch, [d], optimizer=opt_b, step=step)
        assert ra.loss == rb.loss and torch.equal(ra.logits, rb.logits)
        for k, v in ra.grads.items():
            assert torch.equal(v, rb.grads[k]), k
        assert "mjp.unk" not in rb.grads and d.last.mask is None  # nothing selected, nothing moved
    after = dict(defended.named_parameters())
    for k, v in plain.named_parameters():
        assert torch.equal(v, after[k]), k


def test_mjp_shuffles_inside_each_pair_and_keeps_cls_and_both_seps(base: MultipleChoiceMiniLM, batch: dict) -> None:
    model = copy.deepcopy(base).train()
    d = MJP(gamma=0.5, window=32).attach(model)
    model(batch)
    flat, mask = batch["input_ids"].reshape(24, 24), d.last.mask
    assert mask.shape == (24, 24)
    special = (flat == 101) | (flat == 102) | (flat == 0)
    assert not mask[special].any() and mask.sum(1).min() >= 2  # every pair shuffled, specials fixed
    assert torch.equal(torch.gather(flat, 1, d.last.perm).sort(1).values, flat.sort(1).values)
