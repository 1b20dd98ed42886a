"""The CNN, Swin-style and LLaMA-style models: the mechanism each claims, and one-line shape errors."""

from __future__ import annotations

import pytest
import torch

from helpers import SMALL, batch_for
from veil.defenses import create_defense
from veil.errors import VeilError
from veil.models import create_model
from veil.models.llama import apply_rope, rope_angles
from veil.models.swin import SwinBlock, SwinConfig


def _window_of(K: int, w: int, s: int) -> torch.Tensor:
    """The (shifted) window each slot of a K x K grid falls in, after a roll by -s."""
    r, c = torch.meshgrid(torch.arange(K), torch.arange(K), indexing="ij")
    r, c = (r - s) % K, (c - s) % K
    return (r // w * (K // w) + c // w).reshape(-1)


@pytest.mark.parametrize("shift", [False, True])
def test_swin_block_attends_within_its_windows_only(shift: bool) -> None:
    torch.manual_seed(0)
    K, w, D = 8, 4, 16
    blk = SwinBlock(D, 2, K, w, shift, SwinConfig(dim=D)).double()
    x = torch.randn(1, K * K, D, dtype=torch.float64)
    jac = torch.autograd.functional.jacobian(lambda t: blk(t).sum(-1), x)[0, :, 0].abs().sum(-1)  # (N, N)
    seen = jac > 1e-12
    win = _window_of(K, w, blk.shift)
    same = win[:, None] == win[None, :]
    if shift:  # a rolled window that wraps around the edge is split again by the SW-MSA mask
        assert not (seen & ~same).any()
        corner, far = 0, K * K - 1  # (0, 0) and (K-1, K-1): one rolled window, opposite edges
        assert same[corner, far] and not seen[corner, far]
        inner = (K - w // 2) * K - w // 2 - 1  # a slot in the middle of the grid's rolled windows
        assert torch.equal(seen[inner], same[inner])
        return
    assert blk.shift == (w // 2 if shift else 0)
    assert torch.equal(seen, same)


def test_rope_scores_depend_on_the_offset_only() -> None:
    torch.manual_seed(0)
    cos, sin = rope_angles(32, 8, 10000.0)
    q, k = torch.randn(8), torch.randn(8)

    def score(s: int, t: int) -> torch.Tensor:
        qs = apply_rope(q.expand(32, 8)[None, None], cos, sin)[0, 0, s]
        kt = apply_rope(k.expand(32, 8)[None, None], cos, sin)[0, 0, t]
        return qs @ kt

    assert torch.allclose(score(5, 2), score(20, 17), atol=1e-5)
    assert not torch.allclose(score(5, 2), score(5, 4), atol=1e-3)


def test_llama_is_causal_and_has_no_position_table() -> None:
    torch.manual_seed(0)
    model = create_model("llama-tiny", **SMALL["llama-tiny"]).eval()
    batch = batch_for(model)
    ref = model(batch)
    later = {**batch, "input_ids": batch["input_ids"].clone()}
    later["input_ids"][1, 4] = 1500
    out = model(later)
    assert torch.allclose(out[1, :4], ref[1, :4], atol=1e-6)
    assert not torch.allclose(out[1, 4:], ref[1, 4:], atol=1e-4)
    # without position embeddings, a token's first-layer input is the same at every position
    emb = model.embed(batch)
    same = batch["input_ids"][1, 1]
    ids = batch["input_ids"].clone()
    ids[1, 3] = same
    emb = model.embed({**batch, "input_ids": ids})
    assert torch.equal(emb[1, 1], emb[1, 3])
    with pytest.raises(VeilError, match="no position table"):
        model.position_table()


def test_llama_refuses_too_long_sequences_in_one_line() -> None:
    model = create_model("llama-tiny", **SMALL["llama-tiny"], max_len=8)
    ids = torch.ones(1, 9, dtype=torch.long)
    with pytest.raises(VeilError, match="longer than max_len 8"):
        model({"input_ids": ids, "attention_mask": torch.ones_like(ids)})


def test_mjp_on_the_cnn_is_the_patch_shuffle() -> None:
    torch.manual_seed(0)
    model = create_model("resnet-tiny", **SMALL["resnet-tiny"])
    mjp = create_defense("mjp", gamma=0.5, seed=0)
    mjp.attach(model)
    assert mjp.variant == "shuffle" and mjp.aux == "none" and not hasattr(model.mjp, "unk")
    batch = batch_for(model)
    seen = []
    model.stem.register_forward_pre_hook(lambda m, a: seen.append(a[0].detach()))
    model.train()
    model(batch)
    img = seen[-1]
    # the image the convolutions see holds the same pixels, patches moved
    assert not torch.equal(img, batch["pixels"])
    assert torch.equal(img.flatten().sort().values, batch["pixels"].flatten().sort().values)
    assert int(mjp.last.mask.sum()) >= 2


def test_mjp_on_swin_masks_its_absolute_positions() -> None:
    torch.manual_seed(0)
    model = create_model("swin-tiny", **SMALL["swin-tiny"])
    mjp = create_defense("mjp", gamma=0.5, seed=0)
    mjp.attach(model)
    model.train()
    model(batch_for(model))
    st = mjp.last
    assert torch.equal(st.pos_out[st.mask], model.mjp.unk.expand(int(st.mask.sum()), -1))
    assert mjp.aux == "dal" and mjp.aux_loss(model, {}, None) is not None


@pytest.mark.parametrize(
    ("name", "opts", "match"),
    [
        ("swin-tiny", {"image_size": 8, "window": 3}, "window 3 does not divide"),
        ("swin-tiny", {"image_size": 8, "stages": 4}, "cannot be halved 3 times"),
        ("swin-tiny", {"image_size": 8, "dim": 30, "heads": 4}, "not divisible by heads"),
        ("resnet-tiny", {"image_size": 8, "patch_size": 3}, "patch_size 3 does not divide"),
        ("resnet-tiny", {"base_width": 12, "groups": 8}, "not divisible by groups"),
        ("llama-tiny", {"dim": 24, "heads": 8}, "even head width"),
        ("llama-tiny", {"depth": 0}, "depth must be an integer >= 1"),
    ],
)
def test_bad_dims_are_one_line_errors(name: str, opts: dict, match: str) -> None:
    with pytest.raises(VeilError, match=match) as err:
        create_model(name, **opts)
    assert "\n" not in str(err.value)
