"""p-FeSTA with a pretrained frozen head: `model.init` reaches the split head and body, and the
results section's verdict (within 3 points of SL) is computed, not typed."""

from __future__ import annotations

from pathlib import Path

import torch

from results.sections import pfesta_pretrained
from veil.federated.split.models import build_body
from veil.federated.split.multitask import build_parts
from veil.federated.split.spec import split_spec_from_raw
from veil.models import create_model
from veil.models.pretrained import save


def test_model_init_reaches_the_split_head_and_body(tmp_path: Path) -> None:
    torch.manual_seed(3)
    source = create_model("vit-digits", num_classes=2)
    with torch.no_grad():
        source.pos.weight.normal_()  # unlike any seeded init
    save(source, "vit-digits", tmp_path / "pre")
    raw = {
        "model": {"name": "vit-digits", "init": str(tmp_path / "pre")},
        "data": {"name": "digits"},
        "train": {"batch_size": 16, "lr": 0.001, "seed": 0},
        "defense": "permutation",
        "split": {"protocol": "pfesta", "tasks": ["classify"], "clients_per_task": 2, "epochs": 1},
    }
    head, tail = build_parts(split_spec_from_raw(raw), "classify")
    assert torch.equal(head.proj.weight, source.patch_embed.weight)
    assert torch.equal(head.pos, source.pos.weight[1:])
    body = build_body(split_spec_from_raw(raw))
    assert torch.equal(body.blocks[0].attn.q.weight, source.blocks[0].attn.q.weight)
    assert tail.fc.weight.shape == (10, 64)  # the 10-digit classifier is fresh
    scratch, _ = build_parts(split_spec_from_raw({**raw, "model": {"name": "vit-digits"}}), "classify")
    assert not torch.equal(scratch.pos, head.pos)


def _task(sl: list[float], pfesta: list[float]) -> dict:
    util = {d: {"test_accuracy_values": v} for d, v in (("sl", sl), ("festa", sl), ("pfesta", pfesta))}
    leak = {"psnr": 20.0}
    return {
        "utility": util,
        "split": {d: {"bytes_per_client": 2e6} for d in util},
        "leakage": {d: {"feature_inversion": leak} for d in util},
    }


def test_section_verdict_is_the_gap_to_sl() -> None:
    raw = {"defenses": ["sl", "festa", "pfesta"], "federated": {"epochs": 10}}
    summary = {
        "seeds": [0, 1],
        "config": {"tasks": [{"name": "pretrained", **raw}, {"name": "scratch", **raw}]},
        "tasks": {"pretrained": _task([0.80, 0.82], [0.79, 0.80]), "scratch": _task([0.80, 0.82], [0.70, 0.72])},
    }
    text = pfesta_pretrained.render(summary)
    rows = [line for line in text.splitlines() if line.startswith("| pretrained") or line.startswith("| scratch")]
    pf = {r.split(" | ")[0][2:]: r for r in rows if "| pfesta |" in r}
    assert "-1.50" in pf["pretrained"] and "| yes |" in pf["pretrained"]
    assert "-10.00" in pf["scratch"] and "**no**" in pf["scratch"]
    assert "81.00 ± 1.00" in text and "2.00 MB" in text and "20.00" in text
