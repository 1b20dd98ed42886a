"""The MJP Table III analogue's parts: the digit-mosaic set, the segmentation scores, vit-seg (and
its head under MJP's shuffle), and training through the normal loop."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits
from torchmetrics.functional.classification import multiclass_accuracy, multiclass_jaccard_index

from veil.cli import main
from veil.data import load_data
from veil.data.segmentation import confusion_matrix, digit_mosaic, segmentation_scores
from veil.defenses import create_defense
from veil.errors import VeilError
from veil.models import create_model
from veil.training.loop import evaluate


@pytest.fixture(scope="module")
def mosaic():
    return digit_mosaic(train_size=40, test_size=20)


def test_mosaic_labels_are_the_tiles_digit_on_ink_and_background_elsewhere(mosaic) -> None:
    px, lab = mosaic.train["pixels"], mosaic.train["labels"]
    assert px.shape == (40, 1, 16, 16) and lab.shape == (40, 16, 16) and lab.dtype == torch.int64
    assert mosaic.num_classes == 11 and mosaic.class_names[-1] == "background"
    ink = px[:, 0] >= 0.25
    assert bool((lab[~ink] == 10).all()) and bool((lab[ink] < 10).all())
    d = load_digits()
    images = torch.from_numpy(d.images / 16.0).float()
    for i in range(5):  # every 8x8 tile is a sklearn digit and its ink carries that digit's class
        for r in range(2):
            for c in range(2):
                tile = px[i, 0, 8 * r : 8 * r + 8, 8 * c : 8 * c + 8]
                match = (images - tile).abs().flatten(1).amax(1) < 1e-6
                assert bool(match.any())
                classes = lab[i, 8 * r : 8 * r + 8, 8 * c : 8 * c + 8].unique()
                assert set(classes.tolist()) - {10} <= set(d.target[match.numpy()].tolist())


def test_test_mosaics_use_only_test_digits_and_are_seeded() -> None:
    a, b = digit_mosaic(train_size=30, test_size=30), digit_mosaic(train_size=30, test_size=30)
    assert torch.equal(a.test["pixels"], b.test["pixels"]) and torch.equal(a.test["labels"], b.test["labels"])
    assert not torch.equal(a.train["pixels"], digit_mosaic(train_size=30, test_size=30, seed=1).train["pixels"])
    train_tiles = {
        tuple(np.round(t.flatten().numpy(), 4))
        for t in a.train["pixels"][:, 0].unfold(1, 8, 8).unfold(2, 8, 8).reshape(-1, 8, 8)
    }
    test_tiles = {
        tuple(np.round(t.flatten().numpy(), 4))
        for t in a.test["pixels"][:, 0].unfold(1, 8, 8).unfold(2, 8, 8).reshape(-1, 8, 8)
    }
    # sklearn digits hold a few exact duplicates across the split; nearly all test tiles are unseen
    assert len(test_tiles & train_tiles) <= 2


def test_bad_mosaic_options_are_one_line() -> None:
    with pytest.raises(VeilError, match="grid"):
        digit_mosaic(grid=0)
    with pytest.raises(VeilError, match="threshold"):
        digit_mosaic(threshold=1.5)


def test_scores_match_a_hand_computed_example() -> None:
    target = torch.tensor([0, 0, 1, 1, 2, 2])
    pred = torch.tensor([0, 1, 1, 1, 2, 0])
    conf = confusion_matrix(pred, target, 4)  # class 3: in neither, left out of the means
    assert conf.tolist() == [[1, 1, 0, 0], [0, 2, 0, 0], [1, 0, 1, 0], [0, 0, 0, 0]]
    s = segmentation_scores(conf)
    # IoU: 1/3, 2/3, 1/2 -> 0.5; pixel accuracy 4/6; class accuracy 1/2, 1, 1/2 -> 2/3
    assert s["miou"] == pytest.approx(0.5) and s["pixel_accuracy"] == pytest.approx(4 / 6)
    assert s["mean_accuracy"] == pytest.approx(2 / 3)
    # a class predicted but absent from the target: IoU 0 counts, its accuracy is undefined (skipped)
    s = segmentation_scores(confusion_matrix(torch.tensor([0, 1]), torch.tensor([0, 0]), 3))
    assert s["miou"] == pytest.approx(0.25) and s["mean_accuracy"] == pytest.approx(0.5)


def test_scores_agree_with_torchmetrics() -> None:
    g = torch.Generator().manual_seed(0)
    target = torch.randint(0, 11, (4, 16, 16), generator=g)
    pred = torch.where(torch.rand(4, 16, 16, generator=g) < 0.6, target, torch.randint(0, 11, (4, 16, 16), generator=g))
    s = segmentation_scores(confusion_matrix(pred, target, 11))
    assert s["miou"] == pytest.approx(float(multiclass_jaccard_index(pred, target, 11, average="macro")), abs=1e-6)
    assert s["pixel_accuracy"] == pytest.approx(float(multiclass_accuracy(pred, target, 11, average="micro")), abs=1e-6)
    assert s["mean_accuracy"] == pytest.approx(float(multiclass_accuracy(pred, target, 11, average="macro")), abs=1e-6)


def test_vit_seg_predicts_every_pixel(mosaic) -> None:
    model = create_model("vit-seg", num_classes=11)
    batch = {k: v[:3] for k, v in mosaic.train.items()}
    logits = model(batch)
    assert logits.shape == (3, 11, 16, 16) and model.task == "segmentation"
    loss = model.loss(logits, batch)
    loss.backward()
    assert model.patch_embed.weight.grad is not None and float(model.head.weight.grad.abs().sum()) > 0
    # each patch's logits come from its own token: changing one patch's pixels only moves the
    # logits of that patch when the blocks do not mix tokens (depth 0)
    flat = create_model("vit-seg", num_classes=11, depth=1)
    flat.blocks = torch.nn.ModuleList()
    x = dict(batch)
    y = {**batch, "pixels": batch["pixels"].clone()}
    y["pixels"][:, :, :4, :4] += 0.5
    with torch.no_grad():
        diff = (flat(x) - flat(y)).abs().sum((0, 1))
    assert float(diff[:4, :4].min()) > 0 and float(diff[4:, :].max()) == 0 and float(diff[:, 4:].max()) == 0


def test_under_a_shuffle_the_head_output_goes_back_to_its_patch(mosaic) -> None:
    """Without position embeddings the body is permutation-equivariant, so a shuffled forward
    put back in place equals the unshuffled one; the shuffle did move tokens."""
    model = create_model("vit-seg", num_classes=11)
    with torch.no_grad():
        model.pos.weight.zero_()
    batch = {k: v[:4] for k, v in mosaic.train.items()}
    model.eval()
    clean = model(batch)
    mjp = create_defense("mjp", gamma=0.5, variant="shuffle", aux="none", seed=0)
    mjp.attach(model)
    model.train()
    shuffled = model(batch)
    perm = mjp.last.perm
    assert not torch.equal(perm, torch.arange(16).expand_as(perm))
    assert torch.allclose(shuffled, clean, atol=1e-5)


def test_a_transform_that_changes_token_values_is_refused(mosaic) -> None:
    model = create_model("vit-seg", num_classes=11)
    model.set_embedding_transform(lambda tok, pos, movable: (tok + 0.7, pos))
    with pytest.raises(VeilError, match="reorder"):
        model({k: v[:2] for k, v in mosaic.train.items()})


def test_evaluate_scores_pixels(mosaic) -> None:
    model = create_model("vit-seg", num_classes=11)
    out = evaluate(model, mosaic.test, batch_size=7)
    pred = model(mosaic.test).argmax(1)
    want = segmentation_scores(confusion_matrix(pred, mosaic.test["labels"], 11))
    assert out["test_accuracy"] == pytest.approx(want["pixel_accuracy"])
    assert out["test_miou"] == pytest.approx(want["miou"]) and out["test_macc"] == pytest.approx(want["mean_accuracy"])


def test_veil_train_trains_vit_seg_with_mjp(tmp_path: Path) -> None:
    cfg = tmp_path / "seg.yaml"
    cfg.write_text(
        "model: {name: vit-seg, depth: 1}\n"
        "data: {name: digit-mosaic, train_size: 256, test_size: 64}\n"
        "defense: {name: mjp, gamma: 0.1}\n"
        "train: {epochs: 4, batch_size: 32, lr: 0.003, threads: 1}\n"
    )
    assert main(["train", str(cfg), "--out", str(tmp_path / "run"), "--quiet"]) == 0
    s = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert s["model"] == "vit-seg" and s["data"] == "digit-mosaic" and s["defense"] == ["mjp"]
    # better than predicting background everywhere (its pixel share; its mIoU would be ~share / 11)
    background = float((load_data("digit-mosaic", train_size=256, test_size=64).test["labels"] == 10).float().mean())
    assert s["test_accuracy"] > background + 0.01 and s["test_miou"] > 1.5 * background / 11


def test_mjp_sections_compute_their_verdicts() -> None:
    """The Table III and Table I sections (issue 19) print the gap to the baseline and the 1-point verdict."""
    from results.sections import mjp_table1_models, mjp_table3

    seg = {
        "none": {"test_accuracy_values": [0.95], "test_miou_values": [0.80], "test_macc_values": [0.88]},
        "mjp(gamma=0.1)": {"test_accuracy_values": [0.94], "test_miou_values": [0.785], "test_macc_values": [0.87]},
    }
    raw = {
        "name": "segmentation",
        "defenses": ["none", {"name": "mjp", "gamma": 0.1}],
        "run": {"train": {"epochs": 30}},
    }
    text = mjp_table3.render(
        {
            "seeds": [0],
            "config": {"tasks": [raw]},
            "tasks": {"segmentation": {"model": "vit-seg", "data": "digit-mosaic", "utility": seg}},
        }
    )
    row = next(line for line in text.splitlines() if "| mjp(gamma=0.1) |" in line)
    assert "78.50 ± 0.00" in row and "-1.50" in row and "**no**" in row
    util = {"none": {"test_accuracy_values": [0.939]}, "mjp(gamma=0.1)": {"test_accuracy_values": [0.947]}}
    raw = {"name": "vit", "defenses": ["none", {"name": "mjp", "gamma": 0.1}], "run": {"train": {"epochs": 20}}}
    text = mjp_table1_models.render(
        {
            "seeds": [0],
            "config": {"tasks": [raw]},
            "tasks": {"vit": {"model": "vit-digits", "utility": util, "overhead": {"mjp(gamma=0.1)": 1.04}}},
        }
    )
    row = next(line for line in text.splitlines() if "| mjp(gamma=0.1) |" in line)
    assert "+0.80" in row and "| yes |" in row and "1.04" in row and "DeiT-S: 79.8 → 80.5" in row
