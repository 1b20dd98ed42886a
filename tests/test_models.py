"""Every registered model: forward, backward, double backward, and the handles defenses use."""

from __future__ import annotations

import pytest
import torch

from helpers import SMALL, batch_for
from veil.errors import VeilError
from veil.models import create_model, linear_weight, list_models


def test_registry_covers_the_presets() -> None:
    assert set(SMALL) == set(list_models())


@pytest.mark.parametrize("name", list_models())
def test_forward_backward_double_backward(name: str) -> None:
    model = create_model(name, **SMALL[name])
    batch = batch_for(model)
    logits = model(batch)
    loss = model.loss(logits, batch)
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, params, create_graph=True, allow_unused=True)
    penalty = sum((g**2).sum() for g in grads if g is not None)
    penalty.backward()  # the double backward every gradient-matching attack needs
    assert torch.isfinite(loss)
    if model.absolute_positions:
        assert model.position_table().grad is not None
    else:  # CNN, RoPE: no table, and a one-line refusal for whoever asks for one
        with pytest.raises(VeilError, match="has no position table"):
            model.position_table()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in params)


@pytest.mark.parametrize("name", list_models())
def test_handles(name: str) -> None:
    model = create_model(name, **SMALL[name])
    layers = model.attention_layers()
    assert len(layers) == len(model.mlp_up()) == len(model.mlp_down()) == len(model.layer_input_norms())
    if name.startswith("resnet"):
        assert layers == []  # a CNN has no attention
    else:
        assert layers
        up = linear_weight(model.mlp_up()[0])
        assert up.shape[1] == model.width  # (out, in) after the Conv1D fix
    batch = batch_for(model)
    tok = model.embed_tokens(batch)
    rows = 2 * getattr(model, "choices", 1)  # a multiple-choice model embeds each (item, choice) pair
    assert tok.shape[0] == rows and tok.shape[-1] == model.width
    assert model.movable(batch).shape == tok.shape[:2]


@pytest.mark.parametrize("name", list_models())
def test_identity_transform_changes_nothing(name: str) -> None:
    model = create_model(name, **SMALL[name]).eval()
    batch = batch_for(model)
    ref = model(batch)
    model.set_embedding_transform(lambda tok, pos, movable: (tok, pos))
    assert torch.equal(model(batch), ref)
    with pytest.raises(VeilError, match="already has an embedding transform"):
        model.set_embedding_transform(lambda tok, pos, movable: (tok, pos))


def test_position_replacement_reaches_the_output() -> None:
    model = create_model("vit-digits").eval()
    batch = batch_for(model)
    ref = model(batch)
    model.set_embedding_transform(lambda tok, pos, movable: (tok, torch.zeros_like(pos).expand(tok.shape)))
    assert not torch.allclose(model(batch), ref)


def test_hf_bert_adapter_matches_hugging_face_forward() -> None:
    model = create_model("hf-bert", dim=64, depth=2, dropout=0.0).eval()
    batch = batch_for(model)
    ours = model(batch)
    theirs = model.hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    assert torch.allclose(ours, theirs, atol=1e-5)


def test_hf_vit_adapter_matches_hugging_face_forward() -> None:
    model = create_model("hf-vit", dim=64, depth=2, heads=2).eval()
    batch = batch_for(model)
    assert torch.allclose(model(batch), model.hf(pixel_values=batch["pixels"]).logits, atol=1e-5)


def test_hf_gpt2_adapter_matches_hugging_face_forward() -> None:
    model = create_model("hf-gpt2", dim=64, depth=2).eval()
    batch = batch_for(model)
    ours = model(batch)
    theirs = model.hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    real = batch["attention_mask"].bool()
    assert torch.allclose(ours[real], theirs[real], atol=1e-4)


def test_minilm_is_the_pretrained_checkpoint() -> None:
    model = create_model("minilm")
    emb = model.token_embedding().weight
    assert emb.shape == (30522, 384)
    # a pretrained table is far from the N(0, 0.02) init of a fresh BERT
    assert emb.std() > 0.03


def test_unknown_model_and_option_are_one_line_errors() -> None:
    with pytest.raises(VeilError, match="unknown model 'vit-huge'; choose one of"):
        create_model("vit-huge")
    with pytest.raises(
        VeilError, match=r"^model vit-digits: unknown option 'width' \(did you mean 'depth'\?\); options: depth, "
    ):
        create_model("vit-digits", width=3)


def test_vit_patchify_roundtrip() -> None:
    from veil.models import patchify, unpatchify

    x = torch.rand(2, 3, 8, 8)
    assert torch.equal(unpatchify(patchify(x, 2), 2, 3, 8), x)
