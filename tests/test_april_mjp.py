"""april-mjp recovers what MJP leaves in the update; the scoring says what leaks; MJP always moves a patch."""

from __future__ import annotations

import math

import pytest
import torch

from veil.attacks import create_attack, observe
from veil.attacks.april_mjp import masked_span
from veil.attacks.harness import attack_once, score, shuffle_scores
from veil.attacks.jigsaw_solver import place
from veil.data import load_data
from veil.defenses import create_defense
from veil.errors import VeilError
from veil.metrics.image import patch_report, ssim
from veil.models import create_model
from veil.models.vit import patchify


@pytest.fixture(scope="module")
def digits():
    return load_data("digits")


def _mjp_digits(gamma: float, seed: int):
    torch.manual_seed(0)
    model = create_model("vit-digits").double()  # float64 client: the exact identities hold to ~1e-15
    d = create_defense("mjp", gamma=gamma, seed=seed)
    d.attach(model)
    return model.train(), d


@pytest.mark.parametrize("gamma,seed", [(0.27, 3), (0.0, 1)])
def test_april_mjp_recovers_unshuffled_patches_and_masked_set(digits, gamma, seed):
    model, d = _mjp_digits(gamma, seed)
    batch = {"pixels": digits.test["pixels"][5:6].double(), "labels": digits.test["labels"][5:6]}
    rec, ref, _ = attack_once(create_attack("april-mjp"), model, batch, [d], digits, "original", 0)
    s = score(rec, ref, digits)
    assert s["masked_patches"] == (0 if gamma == 0 else rec.stats["masked_found"]) and s["moved_patches"] >= (
        2 if gamma else 0
    )
    assert s["psnr_unshuffled"] >= 100  # exact up to rounding
    if gamma:
        assert s["masked_patches"] >= 2 and s["psnr_masked_set"] >= 100
    assert rec.stats["dal_removed"]
    naive, ref2, _ = attack_once(create_attack("april"), model, batch, [d], digits, "original", 0)
    assert score(naive, ref2, digits)["psnr_unshuffled"] < 40  # DAL's term (and the masked rows) spoil the naive solve


def test_april_mjp_options_are_checked(digits):
    model, d = _mjp_digits(0.27, 0)
    batch = {"pixels": digits.test["pixels"][:1].double(), "labels": digits.test["labels"][:1]}
    with pytest.raises(VeilError, match="april-mjp: option 'place' must be one of 'solver', 'slots', got 'nowhere'"):
        attack_once(create_attack("april-mjp", place="nowhere", iterations=0), model, batch, [d], digits, "original", 0)


def test_patch_report_hand_values():
    x = torch.zeros(1, 1, 4, 4)
    x[..., :2, 2:] = 0.6  # patch 1
    x[..., 2:, :2] = 0.3  # patch 2
    x[..., 2:, 2:] = 0.5  # patch 3
    y = x.clone()
    y[..., 2:, 2:] += 0.1  # unmasked patch 3 off by 0.1
    y[..., :2, 2:] = 0.3 + 0.2  # masked slots 1 and 2 swapped, one of them off by 0.2
    y[..., 2:, :2] = 0.6
    mask = torch.tensor([[False, True, True, False]])
    r = patch_report(x, y, mask)
    assert r["psnr_unshuffled"] == pytest.approx(10 * math.log10(1 / ((0 + 0.01) / 2)))  # 23.01 dB
    assert r["psnr_masked_set"] == pytest.approx(10 * math.log10(1 / ((0.04 + 0) / 2)))  # pairs (0.3, 0.5), (0.6, 0.6)
    filled = y.clone()
    filled[..., :2, 2:], filled[..., 2:, :2] = 0.6, 0.3
    assert r["ssim_unshuffled"] == pytest.approx(ssim(x, filled))
    perm = torch.tensor([[0, 2, 1, 3]])
    s = shuffle_scores({"pixels": x, "mjp_mask": mask, "mjp_perm": perm}, y, [0])
    assert s["masked_patches"] == 2 and s["moved_patches"] == 2 and s["psnr_unshuffled"] == r["psnr_unshuffled"]
    assert patch_report(x, x, mask)["psnr_masked_set"] == 160.0  # exact: the documented floor, not inf
    with pytest.raises(VeilError, match="masked must be"):
        patch_report(x, y, mask[0])


def test_jigsaw_solver_puts_smooth_patches_back():
    r = torch.linspace(0, 1, 16)
    img = (r[:, None] * 0.7 + r[None, :] * 0.3).expand(3, 16, 16)  # a smooth ramp, 4x4 patches of 4x4
    patches = img.reshape(3, 4, 4, 4, 4).permute(1, 3, 0, 2, 4).reshape(16, 3, 4, 4)
    empty = torch.zeros(16, dtype=torch.bool)
    empty[[5, 6, 10]] = True
    shuffled = patches.clone()
    shuffled[[5, 6, 10]] = patches[[10, 5, 6]]
    assign = place(shuffled, empty, (4, 4))
    assert torch.equal(shuffled[assign], patches)


@pytest.mark.parametrize("selection", ["block", "random"])
def test_mjp_with_gamma_above_zero_always_moves_a_patch(selection):
    model = create_model("vit-digits")
    d = create_defense("mjp", gamma=0.03, selection=selection, seed=0)
    d.attach(model)
    movable = torch.ones(512, 16, dtype=torch.bool)
    for _ in range(3):
        mask, perm = d.select(movable, 0.03)
        assert (mask.sum(1) >= 2).all() and ((perm != torch.arange(16)).sum(1) >= 2).all()


def test_mjp_text_with_small_gamma_always_moves_a_token():
    model = create_model("transformer4", num_classes=2, vocab_size=2100, max_len=32)
    d = create_defense("mjp", gamma=0.05, window=8, seed=0)
    d.attach(model)
    movable = torch.ones(512, 24, dtype=torch.bool)
    movable[:, 0] = False
    movable[:, 13:] = False  # windows of 7, 5 and 0 movable tokens
    mask, perm = d.select(movable, 0.05)
    moved = perm != torch.arange(24)
    assert (moved.sum(1) >= 2).all() and not moved[~movable].any()
    assert torch.equal(perm // 8, torch.arange(24).expand(512, 24) // 8)  # still inside its window


def test_masked_span_fixes_the_unmasked_patches_outside_it():
    """Step 3b on a wide-patch ViT (P = 48 > m): the unmasked patches' part outside the masked
    patches' span is exact from the closed form alone, and the span holds the masked patches."""
    torch.manual_seed(0)
    model = create_model("vit-tiny", image_size=16, depth=1, num_classes=4).double()
    d = create_defense("mjp", gamma=0.3, seed=2, aux="none")
    d.attach(model)
    x = torch.rand(1, 3, 16, 16, dtype=torch.float64)
    obs = observe(model.train(), {"pixels": x, "labels": torch.tensor([1])}, [d])
    mask, perm = d.last.mask[0], d.last.perm[0]
    G = obs.grads["pos.weight"][1:]
    dW = obs.grads["patch_embed.weight"]
    assert torch.equal(G.abs().amax(-1) == 0, mask)  # step 1: the masked slots are the zero rows
    V = masked_span(G[~mask], dW, int(mask.sum()))
    X = patchify(x, 4)[0][perm]
    out = torch.eye(48, dtype=torch.float64) - V.t() @ V
    torch.testing.assert_close(torch.linalg.pinv(G[~mask].t()) @ dW @ out, X[~mask] @ out, atol=1e-9, rtol=0)
    torch.testing.assert_close(X[mask] @ out, torch.zeros_like(X[mask]), atol=1e-9, rtol=0)
