"""DP-SGD on every registered model (issue 17): no module aliasing, the optimiser keeps its
parameters, every trainable parameter gets a gradient, and the per-sample gradients are the
per-sample autograd loop's. Also: checkpoints from the aliased HF layout still load.

Before the fix the HF adapters registered ``_emb`` / ``_layers`` / ``_t`` as second module paths;
``functional_call(tie_weights=True)`` then put functorch tensors back on one path, and after one
DP step only 4 of MiniLM's 105 parameters were still the optimiser's.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_model
from torch import Tensor

from helpers import SMALL, batch_for
from veil.defenses.dpsgd import DPSGD, per_sample_grads
from veil.errors import VeilError
from veil.io import load_model_weights
from veil.models import VeilModel, create_model, list_models
from veil.training.step import client_step, compute_loss

TOL = 1e-5  # relative error of per-sample gradients (float64)


def _model(name: str, dtype: torch.dtype = torch.float32) -> tuple[VeilModel, dict[str, Tensor]]:
    model = create_model(name, **SMALL[name]).to(dtype)
    batch = batch_for(model, batch_size=3)
    batch = {k: v.to(dtype) if v.is_floating_point() else v for k, v in batch.items()}
    return model, batch


def _trainable(model: VeilModel) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def _loop_grads(model: VeilModel, batch: dict[str, Tensor]) -> list[dict[str, Tensor]]:
    """One plain autograd backward per sample: the reference per-sample gradients."""
    named = _trainable(model)
    n = next(iter(batch.values())).shape[0]
    out = []
    for i in range(n):
        loss, _ = compute_loss(model, {k: v[i : i + 1] for k, v in batch.items()}, [])
        grads = torch.autograd.grad(loss, list(named.values()), allow_unused=True)
        out.append({k: torch.zeros_like(p) if g is None else g for (k, p), g in zip(named.items(), grads)})
    return out


def _rel(a: Tensor, b: Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize("name", list_models())
def test_no_module_is_reachable_by_two_paths(name: str) -> None:
    model = create_model(name, **SMALL[name])
    paths = [n for n, _ in model.named_modules(remove_duplicate=False)]
    assert len(paths) == len(dict(model.named_modules())), f"{name}: a module is registered under two paths"


MODES = ["auto", *(pytest.param(m, marks=pytest.mark.slow) for m in ("ghost", "hooks", "functorch"))]


def _tied(model: VeilModel) -> bool:
    return len(list(model.named_parameters(remove_duplicate=False))) > len(list(model.parameters()))


def _ghost_on_tied(model: VeilModel, batch: dict[str, Tensor], mode: str, request: pytest.FixtureRequest) -> bool:
    """Opacus: "Parameter tying is not supported with Ghost Clipping": an explicit ghost on tied
    weights is refused at attach with a one-line VeilError, and the model is left as it was."""
    if mode != "ghost" or not _tied(model):
        return False
    before = {n: p.requires_grad for n, p in model.named_parameters()}
    dp = DPSGD(noise_multiplier=0.0, mode=mode)
    with pytest.raises(VeilError, match="tied weights"):
        dp.attach(model)
    assert {n: p.requires_grad for n, p in model.named_parameters()} == before
    auto = DPSGD(noise_multiplier=0.0, mode="auto")
    auto.attach(model)
    try:
        assert auto.engine_mode == "functorch"
        client_step(model, batch, [auto])
    finally:
        auto.detach()
    return True


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list_models())
def test_dp_step_keeps_the_optimizers_parameters(name: str, mode: str, request: pytest.FixtureRequest) -> None:
    model, batch = _model(name)
    if _ghost_on_tied(model, batch, mode, request):
        return
    before = list(model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dp = DPSGD(clip=1.0, noise_multiplier=1.0, mode=mode)
    dp.attach(model)
    try:
        res = client_step(model, batch, [dp], optimizer=opt)
        named = _trainable(model)  # ghost / hooks freeze what Opacus cannot attribute, until detach
    finally:
        dp.detach()
    after = list(model.parameters())
    owned = {id(p) for g in opt.param_groups for p in g["params"]}
    assert len(after) == len(before) and all(a is b for a, b in zip(after, before)), f"{name}: parameters replaced"
    assert all(type(p) is torch.nn.Parameter and id(p) in owned for p in after)
    no_grad = [n for n, p in named.items() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert not no_grad, f"{name}: DP step left no gradient on {len(no_grad)}/{len(named)}, e.g. {no_grad[0]}"
    assert res.grads is not None and set(res.grads) == set(named)  # the exported update holds every gradient
    named = _trainable(model)
    model.zero_grad(set_to_none=True)
    loss, _ = compute_loss(model, batch, [])
    loss.backward()
    plain = [n for n, p in named.items() if p.grad is None]
    assert not plain, f"{name}: loss.backward() after a DP step left .grad None on {len(plain)}/{len(named)}"


@pytest.mark.parametrize("name", list_models())
def test_per_sample_grads_equal_an_autograd_loop(name: str) -> None:
    model, batch = _model(name, torch.float64)
    model.eval()  # no dropout: the loop and the vectorised pass see the same function
    ref = _loop_grads(model, batch)
    grads, losses, _ = per_sample_grads(model, batch, lambda b: compute_loss(model, b, []))
    assert set(grads) == set(ref[0])
    for i, r in enumerate(ref):
        got = torch.cat([grads[k][i].flatten() for k in r])
        want = torch.cat([v.flatten() for v in r.values()])
        assert want.norm() > 0 and _rel(got, want) <= TOL, f"{name}: sample {i} relative error {_rel(got, want):.2e}"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list_models())
def test_dp_gradient_is_the_clipped_per_sample_mean(name: str, mode: str, request: pytest.FixtureRequest) -> None:
    """Noise 0 and a clip below every per-sample norm: DPSGD's gradient, in every engine mode, must
    be mean_i C g_i / ||g_i|| with g_i from the per-sample loop (Abadi et al., Algorithm 1), over
    the parameters the mode trains (ghost / hooks freeze what Opacus cannot attribute). The
    explicit modes run in the slow set (`auto` picks one of them per model in the default run)."""
    model, batch = _model(name, torch.float64)
    model.eval()
    if _ghost_on_tied(model, batch, mode, request):
        return
    probe = DPSGD(noise_multiplier=0.0, mode=mode)
    ref_model = copy.deepcopy(model)
    probe.attach(ref_model)
    frozen = set(probe.frozen)
    probe.detach()
    ref_model = copy.deepcopy(model)
    for n, p in ref_model.named_parameters():
        p.requires_grad_(n not in frozen)
    ref = _loop_grads(ref_model, batch)
    norms = [torch.cat([v.flatten() for v in r.values()]).norm() for r in ref]
    clip = 1e-3 * float(min(norms))
    want = {k: sum(r[k] * (clip / float(nm)) for r, nm in zip(ref, norms)) / len(ref) for k in ref[0]}
    dp = DPSGD(clip=clip, noise_multiplier=0.0, mode=mode)
    dp.attach(model)
    try:
        client_step(model, batch, [dp])
        trained = _trainable(model)
    finally:
        dp.detach()
    assert set(trained) == set(want), f"{name}/{mode}: trains {len(trained)} parameters, the reference {len(want)}"
    assert all(p.grad is not None for p in trained.values()), f"{name}/{mode}: a trainable parameter got no DP gradient"
    got = torch.cat([trained[k].grad.flatten() for k in want])
    flat = torch.cat([want[k].flatten() for k in want])
    assert _rel(got, flat) <= TOL, (
        f"{name}/{mode}: DP gradient vs clipped loop mean, relative error {_rel(got, flat):.2e}"
    )


# ---- checkpoints of the aliased layout -----------------------------------------------------
_ALIASES = {  # the submodules the adapters used to register (name -> path of the real module)
    "hf-bert": {"_emb": "hf.bert.embeddings", "_layers": "hf.bert.encoder.layer"},
    "hf-vit": {"_emb": "hf.vit.embeddings"},
    "hf-gpt2": {"_t": "hf.transformer"},
}


@pytest.mark.parametrize("name", sorted(_ALIASES))
def test_checkpoint_with_the_old_aliased_keys_loads(name: str, tmp_path: Path) -> None:
    old = create_model(name, **SMALL[name])
    for alias, path in _ALIASES[name].items():  # rebuild the old layout: a second path per handle
        old._modules[alias] = old.get_submodule(path)
    save_model(old, str(tmp_path / "old.safetensors"))
    keys = set(load_file(str(tmp_path / "old.safetensors")))
    assert any(k.startswith(tuple(f"{a}." for a in _ALIASES[name])) for k in keys)  # safetensors kept the alias names
    assert not any(k.startswith(tuple(f"{p}." for p in _ALIASES[name].values())) for k in keys)
    new = create_model(name, **SMALL[name])
    load_model_weights(new, tmp_path / "old.safetensors")
    want = dict(old.hf.named_parameters())
    for n, p in new.hf.named_parameters():
        assert torch.equal(p, want[n]), n


def test_checkpoint_of_another_model_still_fails(tmp_path: Path) -> None:
    save_model(create_model("hf-vit", **SMALL["hf-vit"]), str(tmp_path / "vit.safetensors"))
    with pytest.raises(VeilError, match="does not fit the model"):
        load_model_weights(create_model("hf-bert", **SMALL["hf-bert"]), tmp_path / "vit.safetensors")
