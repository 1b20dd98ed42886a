"""The hand-written IG step on veil's ViT (veil.models.vit_grads) computes what autograd computes.

`ViTGrads.grads` must give every parameter's gradient of the model's own loss, and
`ViTGrads.image_grad` the image gradient of any linear function of those gradients (the
second backward), both to float rounding; the IG attack must take the same iterates with it as
with autograd; and models it does not handle must go through autograd.
"""

from __future__ import annotations

import pytest
import torch

from veil.attacks import Knowledge, create_attack, observe
from veil.attacks.inverting import GradientTarget, _forward_loss
from veil.models import create_model
from veil.models.vit import ViT, ViTConfig
from veil.models.vit_grads import ViTGrads


def small_vit(seed: int = 0, classes: int = 3) -> ViT:
    torch.manual_seed(seed)
    model = ViT(ViTConfig(image_size=16, patch_size=4, in_chans=3, num_classes=classes, dim=48, depth=3, heads=3))
    with torch.no_grad():  # move LayerNorm weights and biases off their init (1, 0) so their terms count
        for n, p in model.named_parameters():
            if "ln" in n or "norm" in n:
                p.add_(0.3 * torch.randn_like(p))
    return model.eval()


def compare(model: ViT, names: set[str], B: int, smoothing: float = 0.0) -> tuple[float, float]:
    """(max gradient error / largest gradient entry, max image-gradient error / largest entry)."""
    model.label_smoothing = smoothing
    gen = torch.Generator().manual_seed(B)
    x = torch.rand(B, model.cfg.in_chans, model.cfg.image_size, model.cfg.image_size, generator=gen)
    x.requires_grad_(True)
    labels = torch.randint(0, model.cfg.num_classes, (B,), generator=gen)
    named = [(n, p) for n, p in model.named_parameters() if n in names]
    ref = dict(zip([n for n, _ in named], torch.autograd.grad(
        _forward_loss(model, x, labels, None), [p for _, p in named], create_graph=True
    )))  # fmt: skip
    fast = ViTGrads(model, names)
    parts = fast.grads(x.detach(), labels)
    assert sorted(n for _, ns in parts for n in ns) == sorted(ref)
    flat = {n: ref[n].detach().reshape(-1) for n in ref}
    scale = max(float(v.abs().max()) for v in flat.values())
    err = max(float((t.reshape(-1) - torch.cat([flat[n] for n in ns])).abs().max()) for t, ns in parts) / scale
    w = {n: torch.randn(ref[n].shape, generator=gen) for n in ref}
    (want,) = torch.autograd.grad(sum((ref[n] * w[n]).sum() for n in ref), [x])
    got = fast.image_grad([torch.cat([w[n].reshape(-1) for n in ns]).view_as(t) for t, ns in parts])
    model.label_smoothing = 0.0
    return err, float((got - want).abs().max() / want.abs().max())


@pytest.mark.parametrize(("B", "smoothing"), [(1, 0.0), (3, 0.1)])
def test_grads_and_image_grad_equal_autograd_for_every_parameter(B: int, smoothing: float) -> None:
    model = small_vit()
    err, img = compare(model, {n for n, _ in model.named_parameters()}, B, smoothing)
    assert err < 1e-5 and img < 1e-5


def test_some_parameters_only_and_split_qkv_stacks() -> None:
    model = small_vit(1)
    # single members of the stacked Q/K/V parts (first and last block), the head, a norm, the input layers
    names = {"blocks.0.attn.k.weight", "blocks.2.attn.v.bias", "blocks.2.attn.q.weight", "blocks.1.ln2.weight"}
    names |= {"head.bias", "norm.weight", "pos.weight", "cls.weight", "patch_embed.weight"}
    err, img = compare(model, names, 2)
    assert err < 1e-5 and img < 1e-5
    err, img = compare(model, {"patch_embed.weight", "patch_embed.bias", "pos.weight"}, 1)
    assert err < 1e-5 and img < 1e-5


def test_the_cosine_adjoint_is_the_cosine_nodes_gradient() -> None:
    model = small_vit(2)
    x = torch.rand(1, 3, 16, 16, generator=torch.Generator().manual_seed(5))
    batch = {
        "pixels": torch.rand(1, 3, 16, 16, generator=torch.Generator().manual_seed(6)),
        "labels": torch.tensor([1]),
    }
    obs = observe(model, batch)
    model.eval()
    target = GradientTarget(model, obs.grads)
    xr = x.clone().requires_grad_(True)
    value = target.cosine(target.dummy_grads(_forward_loss(model, xr, batch["labels"], None)))
    (want,) = torch.autograd.grad(value, [xr])
    fast = ViTGrads(model, set(target.names))
    got_value, bars = target.cosine_adjoint(fast.grads(x, batch["labels"]))
    got = fast.image_grad(bars)
    assert got_value == pytest.approx(float(value), rel=1e-5, abs=1e-7)
    assert float((got - want).abs().max() / want.abs().max()) < 1e-4


def test_ig_takes_the_same_iterates_with_either_engine() -> None:
    model = create_model("vit-tiny", num_classes=2)
    batch = {
        "pixels": torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(7)),
        "labels": torch.tensor([1]),
    }
    obs = observe(model, batch)
    settings = dict(iterations=12, restarts=1, layers="all", schedule="step", seed=0)
    know = Knowledge(batch_size=1, labels=batch["labels"])
    fast = create_attack("ig", **settings).reconstruct(obs, know)
    slow = create_attack("ig", **settings, engine="autograd").reconstruct(obs, know)
    # signed steps: Adam sees +-1 per pixel, so the iterates agree exactly unless a gradient entry
    # within rounding of zero flips its sign; allow one pixel-step of difference on a few entries
    diff = (fast.images - slow.images).abs()
    assert float((diff > 1e-5).float().mean()) < 0.01
    assert fast.stats["loss"] == pytest.approx(slow.stats["loss"], rel=1e-3)


def test_models_it_does_not_handle_go_through_autograd() -> None:
    model = small_vit(3)
    assert ViTGrads.supports(model)
    handle = model.blocks[0].register_forward_hook(lambda *a: None)
    assert not ViTGrads.supports(model)
    handle.remove()
    model.set_embedding_transform(lambda tok, pos, movable: (tok, pos))
    assert not ViTGrads.supports(model)
    with pytest.raises(TypeError, match="ViT only"):
        ViTGrads(model, {"head.bias"})

    class Subclass(ViT):  # a subclass may change the forward (ViTSeg does)
        pass

    assert not ViTGrads.supports(Subclass(ViTConfig(image_size=16, dim=48, depth=1, heads=3)))
