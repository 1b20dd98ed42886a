"""The harness hands an adaptive attacker the defense's settings nested under the defense's name
(`veil.attacks.harness.knowledge_for`: ``{"aegis": {...}}``); the adaptive attackers must read them
there, as they do a single flat description."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from veil.attacks import create_attack
from veil.attacks.adaptive import defense_settings, noised_channel
from veil.attacks.harness import attack_once, knowledge_for
from veil.defenses import create_defense
from veil.models import create_model

VOCAB = 300


def _run() -> tuple[torch.nn.Module, dict[str, torch.Tensor], SimpleNamespace]:
    torch.manual_seed(0)
    model = create_model("gpt-tiny", vocab_size=VOCAB, dim=32, depth=2, heads=2)
    model.eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(103, VOCAB, (2, 8), generator=g)
    ids[:, 0] = 101
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.tensor([0, 1])}
    tok = SimpleNamespace(vocab_size=VOCAB, cls_id=101, sep_id=102, pad_id=0)
    data = SimpleNamespace(meta={"tokenizer": tok, "special_ids": [0, 101, 102]}, test=batch)
    return model, batch, data


def test_the_harness_knowledge_is_read_nested_and_flat() -> None:
    model, batch, data = _run()
    d = create_defense("aegis").attach(model)
    know = knowledge_for(batch, data, [d], 0)
    assert "aegis" in know.defense and "head_noise" not in know.defense  # nested by the harness
    for shape in (know.defense, d.describe()):
        assert [s["name"] for s in defense_settings(shape)] == ["aegis"]
        assert noised_channel(shape, "head") and noised_channel(shape, "mlp_down")
    assert not noised_channel({}, "head")
    published = create_defense("aegis", head_noise=0.0, mlp_down_noise=0.0)
    assert not noised_channel({"aegis": published.describe()}, "mlp_down")
    assert noised_channel({"gaussian": {"name": "gaussian", "sigma": 0.1}}, "head")
    d.detach()


def test_presence_head_and_span_unfrozen_are_noise_aware_when_the_harness_runs_them() -> None:
    """Run through `attack_once` (the audit's path): with AEGIS's head noise the head presence test
    is the chi-square one (a noise std estimated), and span-unfrozen keeps only what rises above
    the noise bulk."""
    model, batch, data = _run()
    d = create_defense("aegis").attach(model)
    rec, _, _ = attack_once(create_attack("presence-adaptive", source="head"), model, batch, [d], data, "original", 0)
    assert rec.stats["noise_std"] > 0
    rec, _, _ = attack_once(create_attack("span-unfrozen"), model, batch, [d], data, "original", 0)
    assert rec.stats["noise_aware"] is True
    d.detach()
