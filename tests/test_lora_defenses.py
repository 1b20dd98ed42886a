"""Every registered defense on LoRA (`train.lora`) runs on a GPT-2 and a LLaMA shape, with a test of
what the exported update holds, or refuses in one line; never a traceback."""

from __future__ import annotations

import pytest
import torch

from veil.build import build_run
from veil.config import load_config
from veil.defenses import list_defenses
from veil.errors import VeilError
from veil.models.lora import adapter_pair, lora_modules
from veil.training.step import client_step

LM = ["data=sst2", "data.train_size=32", "data.test_size=8", "data.max_len=12", "train.lora.r=8"]
SHAPES = {
    "gpt2": ["model=hf-gpt2", "model.dim=64", "model.depth=2", *LM],
    "llama": ["model=llama-tiny", "model.dim=64", "model.depth=2", "model.mlp_hidden=96", *LM],
}
#: the defense's settings in these tests (seeded: the exported noise is checked against its law)
SETTINGS = {
    "aegis": ["defense.mlp_noise=1.0", "defense.mlp_down_noise=1.0"],
    "dpsgd": ["defense.noise_multiplier=1.0", "defense.clip=1.0", "defense.seed=3"],
    "gaussian": ["defense.sigma=0.01"],
    "prune": ["defense.ratio=0.9"],
    "mjp": ["defense.gamma=0.3"],
    "permutation": [],
    "none": [],
}
#: the one-line refusals on a causal LM (text): what cannot work and why
REFUSED = {
    "mjp": "mjp shuffles input tokens, which breaks next-token prediction",
    "permutation": "defense 'permutation' does not support text models",
}


def _step(overrides: list[str], n: int = 4) -> tuple[torch.nn.Module, dict, list, dict]:
    model, data, defenses = build_run(load_config(None, overrides))
    batch = {k: v[:n] for k, v in data.train.items()}
    return model, batch, defenses, client_step(model, batch, defenses).grads


def _clean(shape: str, n: int = 4) -> dict[str, torch.Tensor]:
    return _step(SHAPES[shape], n)[3]


def test_every_registered_defense_has_a_lora_case() -> None:
    assert set(list_defenses()) == set(SETTINGS)


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_defense_on_lora_runs_or_refuses_in_one_line(shape: str, name: str) -> None:
    overrides = [*SHAPES[shape], f"defense={name}", *SETTINGS[name]]
    if name in REFUSED:
        with pytest.raises(VeilError) as e:
            _step(overrides)
        assert REFUSED[name] in str(e.value) and "\n" not in str(e.value)
        return
    model, _, defenses, grads = _step(overrides)
    adapters = {n for n, p in model.named_parameters() if ".lora_" in n}
    assert grads and set(grads) <= adapters  # nothing of the frozen base is exported
    clean = _clean(shape)
    if name == "none":
        assert set(grads) == adapters
        for m in lora_modules(model):  # B = 0: dL/dA = 0, dL/dB = s G (A x)^T carries everything
            a, b, _ = adapter_pair(m)
            na, nb = (n for n, p in model.named_parameters() if p is a or p is b)
            assert torch.count_nonzero(grads[na]) == 0 and torch.count_nonzero(grads[nb]) > 0
    elif name == "aegis":
        # channel 1: the attention adapters are frozen (not exported); channel 2: the embedding is
        # frozen under LoRA (nothing to noise); channel 3: eq. (M) on every MLP adapter tensor
        attention = {
            id(p)
            for layer in model.attention_layers()
            for m in (layer.q, layer.k, layer.v, layer.o)
            for p in m.parameters()
        }
        mlp = [p for m in [*model.mlp_up(), *model.mlp_down()] for p in m.parameters() if p.requires_grad]
        named = {id(p): n for n, p in model.named_parameters()}
        assert set(grads) == {named[id(p)] for p in mlp}
        assert not any(id(p) in attention for n, p in model.named_parameters() if n in grads)
        stds = defenses[0].last_std["mlp_up"] + defenses[0].last_std["mlp_down"]
        for n, std in zip([named[id(p)] for p in mlp], stds):
            g = clean[n]
            assert std == pytest.approx(float(g.norm()) / g.numel() ** 0.25, rel=1e-5)  # eq. (M), scale 1
            if std > 0:  # dL/dB: the noise is what eq. (M) says; dL/dA is 0 at B = 0, and so is its noise
                assert float((grads[n] - g).std()) == pytest.approx(std, rel=0.2)
            else:
                assert torch.equal(grads[n], g)
    elif name == "dpsgd":
        assert defenses[0].engine_mode in ("ghost", "functorch") and set(grads) == adapters
        # the adapters' per-sample clipped sum, plus N(0, (sigma C)^2) per entry, over the batch of 4
        noise = torch.cat([(grads[n] * 4 - clean[n] * 4).flatten() for n in grads])
        assert float(noise.std()) == pytest.approx(1.0, rel=0.1)
    elif name == "gaussian":
        noise = torch.cat([(grads[n] - clean[n]).flatten() for n in grads])
        assert set(grads) == adapters and float(noise.std()) == pytest.approx(0.01, rel=0.1)
    elif name == "prune":
        for n, g in grads.items():
            kept = torch.count_nonzero(g)
            assert kept <= g.numel() - round(0.9 * g.numel())
            assert torch.equal(g[g != 0], clean[n][g != 0])  # the kept entries are the clean ones


def test_dpsgd_on_lora_without_noise_or_clipping_is_the_clean_adapter_gradient() -> None:
    """Per-sample gradients of the adapters (Opacus) summed back: with sigma 0 and a clip no sample
    reaches, DP-SGD exports the plain gradient of the adapters (one sample: the LM loss averages
    tokens over the whole batch, per-sample losses over each sample's own)."""
    for shape in SHAPES:
        overrides = [
            *SHAPES[shape],
            "defense=dpsgd",
            "defense.noise_multiplier=0",
            "defense.clip=1000000.0",
            "defense.seed=1",
        ]
        _, _, _, grads = _step(overrides, n=1)
        clean = _clean(shape, n=1)
        assert set(grads) == set(clean)
        assert all(torch.allclose(grads[n], clean[n], atol=1e-6, rtol=1e-4) for n in grads)


def test_aegis_with_adapters_on_attention_only_refuses_in_one_line() -> None:
    with pytest.raises(VeilError) as e:
        build_run(load_config(None, [*SHAPES["llama"], "train.lora.targets=[q, v]", "defense=aegis"]))
    assert "aegis freezes the attention projections and their LoRA adapters" in str(e.value)
    assert "\n" not in str(e.value)


def test_mjp_on_a_lora_classifier_trains_its_own_parameters_beside_the_adapters() -> None:
    """MJP acts on the embedding step, unchanged by LoRA: its E_unk trains and is exported with the
    adapters and the classification head."""
    enc = ["model=transformer4", "model.depth=2", "model.dim=32", "model.heads=2", *LM]
    model, _, _, grads = _step([*enc, "defense=mjp", "defense.gamma=0.3"])
    assert {n for n in grads if ".lora_" not in n} == {"head.weight", "head.bias", "mjp.unk"}
