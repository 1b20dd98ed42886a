"""MJP: jigsaw shuffle, E_unk, DAL/DRL, variants, HF BERT + checkpoints, one-line errors."""

from __future__ import annotations

import copy

import pytest
import torch

from veil.defenses import DEFENSES
from veil.defenses.jigsaw import apply_perm, jigsaw, select_blocks, select_random, select_windows
from veil.defenses.mjp import MJP
from veil.errors import VeilError
from veil.models import create_model
from veil.training.step import client_step


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def image_batch(b: int = 8, seed: int = 0) -> dict[str, torch.Tensor]:
    g = gen(seed)
    return {"pixels": torch.rand(b, 1, 8, 8, generator=g), "labels": torch.randint(0, 10, (b,), generator=g)}


def text_batch(b: int = 4, t: int = 24, seed: int = 0) -> dict[str, torch.Tensor]:
    g = gen(seed)
    ids = torch.randint(1000, 2000, (b, t), generator=g)
    lengths = torch.tensor([t, t - 3, t - 7, 5])[:b]
    pos = torch.arange(t).expand(b, t)
    ids[:, 0] = 101
    ids[pos == (lengths - 1).unsqueeze(1)] = 102
    ids[pos >= lengths.unsqueeze(1)] = 0
    return {"input_ids": ids, "attention_mask": (ids != 0).long(), "labels": torch.arange(b) % 2}


def make(name: str):
    """Tiny real models (small vocabulary keeps the text embedding cheap)."""
    if name.startswith("vit"):
        return create_model(name, num_classes=10)
    return create_model(name, num_classes=2, vocab_size=2100, max_len=32)


# ---- the shuffle ---------------------------------------------------------------------------------
@pytest.mark.parametrize("window", [None, 4, 5])
def test_jigsaw_is_a_permutation_inside_each_window(window: int | None) -> None:
    movable = torch.ones(64, 23, dtype=torch.bool)
    movable[:, 0] = False
    sel = select_windows(movable, 0.6, window, gen(1))
    perm = jigsaw(sel, window, gen(2))
    ar = torch.arange(23).expand(64, 23)
    assert torch.equal(perm.sort(1).values, ar)  # a permutation
    assert torch.equal(perm[~sel], ar[~sel])  # unselected slots stay
    assert torch.equal(sel.gather(1, perm), sel)  # selected slots receive selected tokens
    if window is not None:
        assert torch.equal(perm // window, ar // window)  # never leaves its window
    assert (perm != ar).any()  # it does shuffle


def test_selection_ratio_and_blocks() -> None:
    mov = torch.ones(4000, 16, dtype=torch.bool)
    assert abs(select_random(mov, 0.03, gen()).float().mean().item() - 0.03) < 0.005  # stochastic rounding
    blocks = select_blocks(4000, (4, 4), 0.25, gen())
    assert torch.equal(blocks.sum(1), torch.full((4000,), 4))  # exactly gamma * N
    big = select_blocks(200, (8, 8), 0.3, gen()).view(200, 8, 8).float()
    # block-wise: a selected patch's right neighbour is selected far more often than chance
    both = (big[:, :, 1:] * big[:, :, :-1]).sum() / big[:, :, :-1].sum()
    assert both > 0.5
    assert not select_random(mov, 0.0, gen()).any() and not select_blocks(10, (4, 4), 0.0, gen()).any()


def test_special_and_padding_tokens_never_move() -> None:
    model = make("transformer4")
    d = MJP(gamma=1.0, window=4).attach(model)
    batch = text_batch()
    movable = model.movable(batch)
    for _ in range(5):
        model(batch)
        ids = apply_perm(batch["input_ids"].unsqueeze(-1).float(), d.last.perm).squeeze(-1).long()
        assert torch.equal(ids[~movable], batch["input_ids"][~movable])
        assert not d.last.mask[~movable].any()
        assert torch.equal(ids.sort(1).values, batch["input_ids"].sort(1).values)
    assert (ids != batch["input_ids"]).any()


# ---- zero strength and E_unk ---------------------------------------------------------------------
@pytest.mark.parametrize("name", ["vit-digits", "transformer4"])
def test_gamma_zero_is_bit_identical(name: str) -> None:
    torch.manual_seed(0)
    base = make(name)
    defended = copy.deepcopy(base)
    d = MJP(gamma=0.0, aux="none").attach(defended)
    batch = image_batch() if name.startswith("vit") else text_batch()
    ra = client_step(base.train(), batch, [])
    rb = client_step(defended.train(), batch, [d])
    assert torch.equal(ra.logits, rb.logits)
    for k, v in ra.grads.items():
        assert torch.equal(v, rb.grads[k]), k
    assert "mjp.unk" not in rb.grads  # nothing masked: E_unk receives no gradient


def test_unk_gradient_is_the_sum_over_masked_slots() -> None:
    torch.manual_seed(0)
    model = create_model("vit-digits", num_classes=10)
    d = MJP(gamma=0.4, aux="none").attach(model)
    grabbed = {}
    orig = d._transform

    def spy(tok, pos, movable):
        tok, pos = orig(tok, pos, movable)
        pos.retain_grad()
        grabbed["pos"] = pos
        return tok, pos

    model._embedding_transform = spy
    client_step(model.train(), image_batch(), [d])
    mask = d.last.mask
    assert mask.any()
    expected = grabbed["pos"].grad[mask].sum(0, keepdim=True)
    assert model.mjp.unk.grad.abs().sum() > 0
    torch.testing.assert_close(model.mjp.unk.grad, expected)


def test_unk_gets_zero_gradient_when_nothing_is_masked() -> None:
    model = make("transformer4")
    d = MJP(gamma=0.9, aux="none").attach(model)
    ids = torch.tensor([[101, 102, 0, 0], [101, 102, 0, 0]])  # nothing movable
    client_step(
        model.train(), {"input_ids": ids, "attention_mask": (ids != 0).long(), "labels": torch.tensor([0, 1])}, [d]
    )
    assert not d.last.mask.any()
    assert torch.equal(model.mjp.unk.grad, torch.zeros_like(model.mjp.unk))


def test_unk_is_trained_by_an_optimiser_made_after_attach_and_eval_is_clean() -> None:
    torch.manual_seed(0)
    model = create_model("vit-digits", num_classes=10)
    d = MJP(gamma=0.5).attach(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = model.mjp.unk.detach().clone()
    client_step(model.train(), image_batch(), [d], opt)
    assert not torch.equal(before, model.mjp.unk)
    model.eval()
    with torch.no_grad():
        a = model(image_batch())
        assert d.last.mask is None  # no shuffle at test time unless asked
        d.set_eval_gamma(0.5)
        b = model(image_batch())
        assert d.last.mask is not None and d.last.mask.any()
    assert not torch.equal(a, b)


def test_variants_shuffle_and_nope() -> None:
    model = create_model("vit-digits", num_classes=10)
    d = MJP(gamma=0.5, variant="shuffle").attach(model)
    assert not hasattr(model.mjp, "unk")
    model.train()(image_batch())
    assert d.last.pos_out is d.last.pos  # original PEs kept
    d.detach()
    d2 = MJP(gamma=0.5, variant="nope").attach(model)
    model.eval()(image_batch())
    assert torch.equal(d2.last.pos_out, torch.zeros_like(d2.last.pos))  # no PEs at test time too
    assert d2.aux == "none"


def test_attach_twice_refused_and_detach_removes_parameters() -> None:
    model = create_model("vit-digits", num_classes=10)
    n = len(model.state_dict())
    d = MJP(gamma=0.1).attach(model)
    assert "mjp.unk" in model.state_dict() and "mjp.loc.0.weight" in model.state_dict()
    with pytest.raises(VeilError):
        d.attach(model)
    with pytest.raises(VeilError):
        MJP(gamma=0.1).attach(model)
    d.detach()
    assert len(model.state_dict()) == n and model._embedding_transform is None
    MJP(gamma=0.1).attach(model)  # attachable again
    assert "mjp" in DEFENSES


# ---- auxiliary losses ----------------------------------------------------------------------------
@pytest.mark.parametrize("name,aux", [("vit-digits", "dal"), ("transformer4", "dal"), ("transformer4", "drl")])
def test_aux_loss_falls_when_optimised_on_a_fixed_table(name: str, aux: str) -> None:
    torch.manual_seed(0)
    model = make(name)
    d = MJP(gamma=0.3, aux=aux, aux_lambda=1.0).attach(model)
    batch = image_batch() if name.startswith("vit") else text_batch()
    model.train()
    model.position_table().requires_grad_(False)  # the table is fixed: only g learns
    opt = torch.optim.Adam(model.mjp.loc.parameters(), lr=3e-3)
    losses = []
    with torch.no_grad():
        model(batch)  # records the slots' PEs and the shuffle mask
    for _ in range(150):
        loss = d.aux_loss(model, batch, None)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], (losses[0], losses[-1])


# ---- Hugging Face BERT + checkpoints -----------------------------------------------------------
def _hf_round_trip(model, tmp_path) -> None:
    from safetensors.torch import load_file, save_model

    d = MJP(gamma=0.5, window=4, aux="dal").attach(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    r = client_step(model.train(), text_batch(t=16), [d], opt)
    assert r.grads["mjp.unk"].abs().sum() > 0 and torch.isfinite(torch.tensor(r.loss))
    save_model(model, str(tmp_path / "ckpt.safetensors"))  # HF adapters alias modules: save_model dedups
    loaded = load_file(str(tmp_path / "ckpt.safetensors"))
    assert torch.equal(loaded["mjp.unk"], model.mjp.unk.detach())
    return loaded


def test_hf_bert_trains_one_step_and_round_trips_a_checkpoint(tmp_path) -> None:
    torch.manual_seed(0)
    model = create_model("hf-bert", dim=32, depth=2, heads=2, max_len=32, vocab_size=2100)
    _hf_round_trip(model, tmp_path)
    fresh = create_model("hf-bert", dim=32, depth=2, heads=2, max_len=32, vocab_size=2100)
    MJP(gamma=0.5, window=4, aux="dal").attach(fresh)
    from safetensors.torch import load_model

    load_model(fresh, str(tmp_path / "ckpt.safetensors"))
    fresh.eval(), model.eval()
    with torch.no_grad():
        assert torch.equal(fresh(text_batch(t=16)), model(text_batch(t=16)))


def test_minilm_with_mjp_trains_one_step(tmp_path) -> None:
    model = create_model("minilm", num_classes=2)
    _hf_round_trip(model, tmp_path)


def test_hf_vit_with_mjp_trains() -> None:
    model = create_model("hf-vit", image_size=8, patch_size=2, in_chans=1, dim=32, depth=1, heads=2)
    d = MJP(gamma=0.3).attach(model)
    r = client_step(model.train(), image_batch(), [d])
    assert r.grads["mjp.unk"].abs().sum() > 0 and "mjp.loc.0.weight" in r.grads


# ---- errors --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kw",
    [
        {"gamma": 1.5},
        {"gamma": -0.1},
        {"window": 1},
        {"window": 2.5},
        {"selection": "grid"},
        {"aux": "xyz"},
        {"variant": "abc"},
        {"aux_lambda": -1},
        {"variant": "nope", "aux": "dal"},
    ],
)
def test_bad_values_are_one_line_errors(kw) -> None:
    with pytest.raises(VeilError) as e:
        MJP(**kw)
    assert "\n" not in str(e.value) and "mjp" in str(e.value)


def test_lm_models_are_refused() -> None:
    with pytest.raises(VeilError, match="next-token"):
        MJP().attach(create_model("gpt-tiny", vocab_size=100))


# ---- commands: veil eval --shuffle-gamma, veil analyze pe -------------------------------------
def test_eval_shuffle_and_analyze_pe_commands(tmp_path) -> None:
    import json

    from veil.cli import main
    from veil.config import load_config
    from veil.training.loop import train

    cfg = load_config(
        None, ["model=vit-digits", "data=digits", "defense=mjp", "gamma=0.1", "train.max_steps=3", "train.epochs=1"]
    )
    run = tmp_path / "run"
    train(cfg, run, progress=False)
    assert main(["eval", str(run), "--shuffle-gamma", "0.27", "--out", str(tmp_path / "ev")]) == 0
    s = json.loads((tmp_path / "ev" / "summary.json").read_text())
    assert 0 <= s["test_accuracy"] <= 1 and s["unk_at_shuffled"] and s["shuffle_gamma"] == 0.27
    assert main(["eval", str(run), "--shuffle-gamma", "1.5"]) == 2  # one-line error, exit 2
    assert main(["analyze", "pe", str(run), "--out", str(tmp_path / "pe")]) == 0
    res = json.loads((tmp_path / "pe" / "pe_analysis.json").read_text())
    assert res["rows"] == 16 and res["explained_variance_percent"]["10"] <= 100
    ev = list(res["explained_variance_percent"].values())
    assert ev == sorted(ev)
    for name in ("pe_pca_1d.png", "pe_pca_2d.png", "pe_pca_3d.png", "pe_analysis.md"):
        assert (tmp_path / "pe" / name).stat().st_size > 0


def test_pca_explained_variance_matches_a_hand_value() -> None:
    import numpy as np

    from veil.analysis.pe import explained_variance, pca

    x = np.array([[3.0, 0, 0], [-3, 0, 0], [0, 1, 0], [0, -1, 0]])  # variances 18 : 2 : 0
    _, ratios = pca(x)
    assert explained_variance(ratios, 3) == {1: 90.0, 2: 100.0, 3: 100.0}


def test_unk_init_mean_starts_at_the_position_table_centroid() -> None:
    model = create_model("transformer4", max_len=32)
    MJP(gamma=0.5, unk_init="mean").attach(model)
    torch.testing.assert_close(model.mjp.unk.detach()[0], model.position_table().detach().mean(0))
    with pytest.raises(VeilError) as e:
        MJP(unk_init="zeros")
    assert "unk_init" in str(e.value) and "mean" in str(e.value) and "\n" not in str(e.value)
