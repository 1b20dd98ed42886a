"""Attacks on LoRA updates (`train.lora`): the span attack on the adapters' gradients (dL/dB = s G
(A x)^T spans the projected inputs A x) recovers a known sentence on a GPT-2 and a LLaMA shape at
r = 8, an encoder's batch at r = 32, and stops where the batch's tokens fill the rank; presence is
not applicable (the embedding is frozen); labels, TAG and LAMP read the adapters' gradients."""

from __future__ import annotations

import pytest

from veil.attacks import Knowledge, create_attack
from veil.attacks.base import observe
from veil.attacks.span.lora import adapter_span
from veil.attacks.text_opt import matched_gradients
from veil.build import build_run
from veil.config import load_config
from veil.errors import VeilError

LM = ["data=sst2", "data.train_size=64", "data.test_size=8", "data.max_len=16"]
SHAPES = {
    "gpt2": ["model=hf-gpt2", "model.dim=128", "model.depth=2", *LM],
    "llama": ["model=llama-tiny", "model.dim=128", "model.depth=2", "model.mlp_hidden=256", *LM],
    "gpt-tiny": ["model=gpt-tiny", "model.depth=2", *LM],
}
#: the first SST-2 training sentence: [CLS] + 5 WordPiece tokens + [SEP] (6 reach the loss of a causal LM)
SENTENCE = [101, 2064, 2156, 2302, 3110, 10339, 102]


def _observe(overrides: list[str], n: int = 1):
    model, data, defenses = build_run(load_config(None, overrides))
    batch = {k: v[:n] for k, v in data.train.items()}
    know = Knowledge(batch_size=n, seq_len=batch["input_ids"].shape[1], tokenizer=data.meta["tokenizer"])
    return observe(model, batch, defenses), know, batch


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_span_on_lora_r8_recovers_a_known_sentence(shape: str) -> None:
    obs, know, batch = _observe([*SHAPES[shape], "train.lora.r=8"])
    assert batch["input_ids"][0][batch["attention_mask"][0].bool()].tolist() == SENTENCE
    assert not any(".base_layer." in n for n in obs.grads)  # the update holds adapters only
    rec = create_attack("span").reconstruct(obs, know)
    assert rec.token_ids == [SENTENCE]
    assert rec.stats["source"] == "lora" and not rec.stats["full_rank"]


def test_span_on_a_lora_encoder_recovers_its_batch_at_r32() -> None:
    enc = ["model=transformer4", "data=sst2", "data.train_size=64", "data.test_size=8", "data.max_len=12"]
    obs, know, batch = _observe([*enc, "train.lora.r=32"], n=2)
    rec = create_attack("span").reconstruct(obs, know)
    true = [ids[m.bool()].tolist() for ids, m in zip(batch["input_ids"], batch["attention_mask"])]
    assert sorted(rec.token_ids) == sorted(true)


def test_the_adapter_span_is_rank_limited_by_r() -> None:
    """Each adapter's span has rank <= min(tokens, r): 4 sentences (31 tokens) fill r = 8 (every
    candidate passes, nothing is recovered), and r = 64 keeps a gap."""
    for r, full in ((8, True), (64, False)):
        obs, _, batch = _observe([*SHAPES["gpt-tiny"], f"train.lora.r={r}"], n=4)
        span = adapter_span(obs, 0)
        ranks = [s.rank for s, _ in span.blocks]
        assert all(k <= min(r, int(batch["attention_mask"].sum())) for k in ranks)
        assert all(k == r for k in ranks) == full


def test_presence_on_lora_is_not_applicable_in_one_line() -> None:
    obs, know, _ = _observe([*SHAPES["llama"], "train.lora.r=8"])
    with pytest.raises(VeilError) as e:
        create_attack("presence").reconstruct(obs, know)
    assert str(e.value).startswith("presence is not applicable: the token embedding does not train")


def test_tag_and_lamp_match_the_adapters_gradients() -> None:
    obs, know, batch = _observe([*SHAPES["gpt-tiny"], "train.lora.r=8"])
    names = set(matched_gradients(obs, "tag"))
    assert names == set(obs.grads) and all(".lora_" in n for n in names)
    for name in ("tag", "lamp"):
        rec = create_attack(name, iterations=40).reconstruct(obs, know)
        assert len(rec.token_ids) == 1 and rec.stats["work"]["iterations"] == 40


def test_labels_on_a_lora_classifier_read_its_trained_head() -> None:
    enc = ["model=transformer4", "data=sst2", "data.train_size=64", "data.test_size=8", "data.max_len=12"]
    obs, know, batch = _observe([*enc, "train.lora.r=8"], n=4)
    rec = create_attack("labels").reconstruct(obs, know)
    assert sorted(rec.labels.tolist()) == sorted(batch["labels"].tolist())


def test_veil_attack_on_a_lora_llama_config_rebuilds_its_sentences(tmp_path) -> None:
    """End to end, no user Python: `veil attack` on a config with train.lora (SST-2 cut to 8 tokens:
    7 reach the loss, below r = 8)."""
    import json

    from veil.cli import main

    cfg = tmp_path / "lora.yaml"
    cfg.write_text(
        "model: {name: llama-tiny, depth: 2}\ndata: {name: sst2, max_len: 8, train_size: 64, test_size: 16}\n"
        "train: {lora: {r: 8}}\n"
    )
    out = tmp_path / "out"
    args = ["attack", str(cfg), "--attack", "span", "--batch-size", "1", "--samples", "2", "--out", str(out), "--quiet"]
    assert main(args) == 0
    span = json.loads((out / "summary.json").read_text())["attacks"]["span"]
    assert span["token_recovery"] == 1.0 and span["exact_recovery"] == 1.0
