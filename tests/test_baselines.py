"""Baselines: DP-SGD (torch.func per-sample gradients), top-k pruning, plain Gaussian noise."""

from __future__ import annotations

import pytest
import torch

from veil.defenses import create_defense
from veil.defenses.baselines import prune_topk_
from veil.defenses.dpsgd import per_sample_grads
from veil.errors import VeilError
from veil.models import create_model
from veil.training.step import client_step, compute_loss

VOCAB = 300


def tiny(name: str = "transformer4") -> torch.nn.Module:
    torch.manual_seed(0)
    return create_model(name, vocab_size=VOCAB, dim=32, depth=2, heads=2)


def batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(103, VOCAB, (4, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[3, 6:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([0, 1, 1, 0])}


@pytest.mark.parametrize("name", ["transformer4", "gpt-tiny"])
def test_per_sample_grads_match_a_loop(name: str) -> None:
    model, b = tiny(name), batch()
    grads, losses, _ = per_sample_grads(model, b, lambda x: compute_loss(model, x, []))
    for i in range(4):
        model.zero_grad()
        one = {k: v[i : i + 1] for k, v in b.items()}
        loss = model.loss(model(one), one)
        loss.backward()
        assert float(losses[i]) == pytest.approx(float(loss.detach()), rel=1e-5)
        for n, p in model.named_parameters():
            assert torch.allclose(grads[n][i], p.grad, atol=1e-6), n


def test_dpsgd_without_noise_and_clipping_is_the_mean_gradient() -> None:
    model, b = tiny(), batch()
    clean = client_step(model, b, []).grads
    d = create_defense("dpsgd", clip=1e9, noise_multiplier=0.0, chunk=3).attach(model)
    res = client_step(model, b, [d])
    assert res.grads.keys() == clean.keys()
    for k in clean:
        assert torch.allclose(res.grads[k], clean[k], atol=1e-6), k
    assert res.logits.shape == (4, 2)


def test_dpsgd_clips_and_noise_changes_each_step() -> None:
    model, b = tiny(), batch()
    d = create_defense("dpsgd", clip=1e-3, noise_multiplier=0.0).attach(model)
    g = client_step(model, b, [d]).grads
    assert torch.cat([t.flatten() for t in g.values()]).norm() <= 1e-3 + 1e-7  # mean of clipped
    d.detach()
    d = create_defense("dpsgd", clip=1.0, noise_multiplier=1.0, seed=5).attach(model)
    g1, g2 = client_step(model, b, [d], step=0).grads, client_step(model, b, [d], step=1).grads
    assert not torch.equal(g1["tok.weight"], g2["tok.weight"])
    d.detach()
    d = create_defense("dpsgd", clip=1.0, noise_multiplier=1.0, seed=5).attach(model)
    assert torch.equal(client_step(model, b, [d], step=0).grads["tok.weight"], g1["tok.weight"])  # seeded


def test_prune_keeps_exactly_the_top_k() -> None:
    g = torch.randn(10, 10, generator=torch.Generator().manual_seed(0))
    want = g.abs().flatten().sort(descending=True).values[:30]
    out = g.clone()
    prune_topk_(out, 0.7)
    kept = out.flatten()[out.flatten() != 0]
    assert kept.numel() == 30
    assert torch.equal(kept.abs().sort(descending=True).values, want)
    assert torch.equal(out[out != 0], g[out != 0])
    model, b = tiny(), batch()
    d = create_defense("prune", ratio=0.9).attach(model)
    res = client_step(model, b, [d])
    w = res.grads["blocks.0.mlp.fc1.weight"]
    assert int((w != 0).sum()) == w.numel() - round(0.9 * w.numel())


def test_gaussian_noise_and_zero_strength() -> None:
    model, b = tiny(), batch()
    clean = client_step(model, b, []).grads
    for name, kw in (("gaussian", dict(sigma=0.0)), ("prune", dict(ratio=0.0))):
        d = create_defense(name, **kw).attach(model)
        res = client_step(model, b, [d])
        assert all(torch.equal(res.grads[k], clean[k]) for k in clean)
        d.detach()
    d = create_defense("gaussian", sigma=0.5, seed=1).attach(model)
    noisy = client_step(model, b, [d]).grads
    diff = torch.cat([(noisy[k] - clean[k]).flatten() for k in clean])
    assert float(diff.std()) == pytest.approx(0.5, rel=0.02)


@pytest.mark.parametrize(
    "name, kw, msg",
    [
        ("dpsgd", dict(clip=0), "clip"),
        ("dpsgd", dict(noise_multiplier=-1), "noise_multiplier"),
        ("dpsgd", dict(chunk=0), "chunk"),
        ("prune", dict(ratio=1.5), "ratio"),
        ("gaussian", dict(sigma=-0.1), "sigma"),
    ],
)
def test_bad_settings(name: str, kw: dict, msg: str) -> None:
    with pytest.raises(VeilError, match=msg) as e:
        create_defense(name, **kw)
    assert "\n" not in str(e.value)


def test_attach_twice_is_an_error() -> None:
    model = tiny()
    d = create_defense("prune").attach(model)
    with pytest.raises(VeilError, match="already attached"):
        d.attach(model)
