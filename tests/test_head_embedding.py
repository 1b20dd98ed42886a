"""head-embedding: a head-only update of one sentence gives the frozen MiniLM embedding exactly
(dL/dW_k / dL/db_k) and so the sentence among candidates; DP-SGD noise at sigma 1 hides it."""

from __future__ import annotations

import pytest

from veil.attacks import create_attack
from veil.attacks.base import Knowledge, observe
from veil.build import build_run
from veil.config import from_dict
from veil.defenses.dpsgd import DPSGD
from veil.errors import VeilError

CFG = {
    "model": {"name": "minilm", "dropout": 0.0, "pooling": "mean"},
    "data": {"name": "sst2", "max_len": 32, "train_size": 16, "test_size": 24},
}


@pytest.fixture(scope="module")
def setup():
    model, data, _ = build_run(from_dict(CFG))
    pool = {k: v for k, v in data.test.items() if k != "labels"}
    return model, data, pool


def _attack(model, data, pool, i: int, defenses: list) -> tuple[list[int], dict]:
    batch = {k: v[i : i + 1] for k, v in data.test.items()}
    obs = observe(model, batch, defenses)
    rec = create_attack("head-embedding").reconstruct(obs, Knowledge(batch_size=1, aux_data={"candidates": pool}))
    truth = batch["input_ids"][0][batch["attention_mask"][0].bool()].tolist()
    return rec.token_ids[0] == truth, rec.stats


def test_a_head_only_update_identifies_its_sentence(setup) -> None:
    model, data, pool = setup
    d = DPSGD(clip=1e9, noise_multiplier=0.0, trainable="classifier", chunk=8).attach(model)  # head only, no noise
    try:
        found = [_attack(model, data, pool, i, [d]) for i in range(6)]
    finally:
        d.detach()
    assert all(ok for ok, _ in found)
    assert min(s["cosine"] for _, s in found) > 0.9999 and all(s["pool"] == 24 for _, s in found)


def test_dp_noise_hides_the_embedding(setup) -> None:
    model, data, pool = setup
    d = DPSGD(clip=1.0, noise_multiplier=1.0, trainable="classifier", chunk=8, seed=5).attach(model)
    try:
        found = [_attack(model, data, pool, i, [d]) for i in range(6)]
    finally:
        d.detach()
    assert sum(ok for ok, _ in found) <= 1  # chance is 1 in 24 per sentence
    assert max(s["cosine"] for _, s in found) < 0.9


def test_no_pool_is_one_line(setup) -> None:
    model, data, _ = setup
    obs = observe(model, {k: v[:1] for k, v in data.test.items()}, [])
    with pytest.raises(VeilError, match="needs a candidate pool"):
        create_attack("head-embedding").reconstruct(obs, Knowledge(batch_size=1))


def test_the_harness_grants_the_pool_and_scores_the_identified_sentence(setup) -> None:
    from veil.attacks.harness import attack_once, score

    model, data, _ = setup
    batch = {k: v[3:4] for k, v in data.test.items()}
    rec, ref, _ = attack_once(create_attack("head-embedding"), model, batch, [], data, "original", 0)
    assert score(rec, ref, data)["rouge1"] == 1.0


def test_a_batch_of_four_is_pursued_sentence_by_sentence(setup) -> None:
    """Batch 4, binary head: dW's rows mix the four embeddings; the matching pursuit over the pool
    returns the four sentences (a pool smaller than the width represents the mixture uniquely)."""
    model, data, pool = setup
    batch = {k: v[4:8] for k, v in data.test.items()}
    d = DPSGD(clip=1e9, noise_multiplier=0.0, trainable="classifier", chunk=8).attach(model)
    try:
        rec = create_attack("head-embedding").reconstruct(
            observe(model, batch, [d]), Knowledge(batch_size=4, aux_data={"candidates": pool})
        )
    finally:
        d.detach()
    truth = [batch["input_ids"][i][batch["attention_mask"][i].bool()].tolist() for i in range(4)]
    assert len(rec.token_ids) == 4 and sorted(rec.token_ids) == sorted(truth)
    assert rec.stats["residual"] < 1e-6
