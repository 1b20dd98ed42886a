"""DP-SGD on Opacus (issue 17): every per-sample mode equals the plain gradient mean without noise
and clipping, clips, draws fresh noise every step, the accountant's epsilon is Opacus' own,
target_epsilon round-trips, Poisson batches, the loop logs epsilon, and bad settings are one-line
errors. Veil's own models (raw position slice) and a small HF BERT (Opacus hooks) both."""

from __future__ import annotations

import json
import math

import pytest
import torch
from opacus.accountants import PRVAccountant, RDPAccountant

from helpers import SMALL, batch_for
from veil.config import from_dict
from veil.defenses import create_defense
from veil.defenses.dpsgd import DPSGD
from veil.errors import VeilError
from veil.models import VeilModel, create_model
from veil.training.loop import poisson_batches, train
from veil.training.step import client_step

#: (model, mode, trainable): veil's transformer under functorch; HF BERT under every mode with the
#: raw-read tables frozen (explicit ghost / hooks) or kept out by `trainable`
CASES = [
    ("transformer4", "functorch", None),
    ("transformer4", "auto", None),
    ("hf-bert", "ghost", None),
    ("hf-bert", "hooks", None),
    ("hf-bert", "functorch", None),
    ("hf-bert", "auto", r"layer\.1\.|classifier"),
]


def _model(name: str) -> tuple[VeilModel, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = create_model(name, **{**SMALL[name], "dropout": 0.0})
    torch.manual_seed(1)
    return model, batch_for(model, batch_size=5, seq_len=9)


def _flat(grads: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([g.flatten() for g in grads.values()])


@pytest.mark.parametrize("name,mode,trainable", CASES)
def test_no_noise_and_huge_clip_is_the_plain_gradient_mean(name: str, mode: str, trainable: str | None) -> None:
    model, b = _model(name)
    d = DPSGD(clip=1e9, noise_multiplier=0.0, mode=mode, trainable=trainable, chunk=2).attach(model)
    trainable_now = {n for n, p in model.named_parameters() if p.requires_grad}
    dp = client_step(model, b, [d]).grads
    d.detach()
    plain = client_step(model, b, []).grads
    assert set(dp) == trainable_now and len(dp) > 0
    for k in dp:
        assert torch.allclose(dp[k], plain[k], atol=1e-5, rtol=1e-4), k


@pytest.mark.parametrize("name,mode,trainable", CASES)
def test_each_sample_is_clipped(name: str, mode: str, trainable: str | None) -> None:
    model, b = _model(name)
    d = DPSGD(clip=1e-4, noise_multiplier=0.0, mode=mode, trainable=trainable, chunk=2).attach(model)
    g = _flat(client_step(model, b, [d]).grads)
    # every per-sample gradient is far above 1e-4, so each is scaled to norm 1e-4 exactly:
    # the mean of 5 such vectors has norm <= 1e-4 and > 0
    assert 0 < g.norm() <= 1e-4 * (1 + 1e-4)
    d.detach()


def test_modes_agree_on_the_clipped_update() -> None:
    model, b = _model("hf-bert")
    out = {}
    for mode in ("ghost", "hooks", "functorch"):
        d = DPSGD(clip=0.5, noise_multiplier=0.0, mode=mode, trainable=r"layer\.|classifier").attach(model)
        out[mode] = _flat(client_step(model, b, [d]).grads)
        d.detach()
    assert torch.allclose(out["ghost"], out["functorch"], atol=1e-6)
    assert torch.allclose(out["hooks"], out["functorch"], atol=1e-6)


@pytest.mark.parametrize("mode", ["ghost", "functorch"])
def test_noise_is_fresh_every_step_and_seeded(mode: str) -> None:
    model, b = _model("hf-bert")
    d = DPSGD(clip=1.0, noise_multiplier=1.0, seed=5, mode=mode).attach(model)
    g1, g2 = _flat(client_step(model, b, [d]).grads), _flat(client_step(model, b, [d]).grads)
    d.detach()
    assert not torch.allclose(g1, g2)
    d = DPSGD(clip=1.0, noise_multiplier=1.0, seed=5, mode=mode).attach(model)
    assert torch.allclose(_flat(client_step(model, b, [d]).grads), g1, atol=1e-6)  # replayed by the seed
    d.detach()
    # the noise std of the mean is sigma * C / B: far above the clipped signal (<= C)
    assert float(g1.std()) == pytest.approx(1.0 / 5, rel=0.05)


def test_auto_picks_ghost_only_when_hooks_cover_every_parameter() -> None:
    model, _ = _model("hf-bert")
    d = DPSGD(noise_multiplier=1.0).attach(model)
    assert d.engine_mode == "functorch" and not d.frozen  # the position table is read as a slice
    d.detach()
    d = DPSGD(noise_multiplier=1.0, mode="ghost").attach(model)
    assert d.engine_mode == "ghost" and "hf.bert.embeddings.position_embeddings.weight" in d.frozen
    assert not model.hf.bert.embeddings.position_embeddings.weight.requires_grad
    d.detach()
    assert all(p.requires_grad for p in model.parameters())  # detach restores
    assert not hasattr(model, "autograd_grad_sample_hooks")  # and removes Opacus' hooks
    d = DPSGD(noise_multiplier=1.0, trainable="classifier").attach(model)
    assert d.engine_mode == "ghost"
    d.detach()


def test_attach_twice_is_refused() -> None:
    model, _ = _model("hf-bert")
    d = DPSGD(noise_multiplier=1.0, mode="ghost").attach(model)
    with pytest.raises(VeilError, match="already attached"):
        d.attach(model)
    d.detach()


@pytest.mark.parametrize("acc,cls", [("rdp", RDPAccountant), ("prv", PRVAccountant)])
def test_epsilon_is_the_accountants(acc: str, cls: type) -> None:
    d = DPSGD(noise_multiplier=1.1, accountant=acc)
    d.prepare(n_train=1000, batch_size=50, steps=200)
    ref = cls()
    for _ in range(200):
        ref.step(noise_multiplier=1.1, sample_rate=0.05)
    assert d.privacy()["delta"] == 1e-3
    assert d.privacy(200)["epsilon"] == pytest.approx(ref.get_epsilon(delta=1e-3), rel=1e-3)


@pytest.mark.parametrize("target", [1.0, 3.0, 8.0])
def test_target_epsilon_round_trips(target: float) -> None:
    d = DPSGD(target_epsilon=target)
    d.prepare(n_train=8000, batch_size=256, steps=320)
    eps = d.privacy(320)["epsilon"]
    assert target - 0.05 <= eps <= target + 1e-6 and d.noise_multiplier > 0


def test_poisson_batches_draw_each_sample_with_the_sample_rate() -> None:
    split = {"x": torch.arange(1000)}
    sizes = [len(b["x"]) for b in poisson_batches(split, 100, torch.Generator().manual_seed(0))]
    assert len(sizes) == 10 and len(set(sizes)) > 1
    assert abs(sum(sizes) / 10 - 100) < 3 * math.sqrt(100 * 0.9 / 10)


def test_training_logs_epsilon_per_epoch_and_in_the_summary(tmp_path) -> None:
    cfg = from_dict(
        {
            "model": {"name": "transformer4", "dim": 16, "depth": 1, "heads": 2},
            "data": {"name": "sst2", "max_len": 12, "train_size": 64, "test_size": 16},
            "defense": {"name": "dpsgd", "target_epsilon": 2.0, "clip": 1.0},
            "train": {"epochs": 2, "batch_size": 16, "threads": 1},
        }
    )
    summary = train(cfg, tmp_path, progress=False)
    priv = summary["privacy"]
    assert priv["epsilon"] == pytest.approx(2.0, abs=0.05) and priv["delta"] == 1 / 64 and priv["steps"] == 8
    assert priv["mode"] == "functorch" and priv["sample_rate"] == 0.25
    evals = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if '"eval"' in line]
    assert [e["epoch"] for e in evals] == [1, 2] and evals[0]["epsilon"] < evals[1]["epsilon"] == priv["epsilon"]


@pytest.mark.parametrize(
    "kw,match",
    [
        ({}, "exactly one of noise_multiplier"),
        ({"noise_multiplier": 1.0, "target_epsilon": 3.0}, "exactly one of"),
        ({"noise_multiplier": -1}, "noise_multiplier"),
        ({"target_epsilon": 0}, "target_epsilon"),
        ({"noise_multiplier": 1.0, "clip": 0}, "clip"),
        ({"noise_multiplier": 1.0, "delta": 1.5}, "delta"),
        ({"noise_multiplier": 1.0, "mode": "fast"}, "mode must be one of"),
        ({"noise_multiplier": 1.0, "accountant": "gdp2"}, "accountant must be one of"),
        ({"noise_multiplier": 1.0, "trainable": "(("}, "regular expression"),
        ({"noise_multiplier": 1.0, "chunk": 0}, "chunk"),
    ],
)
def test_bad_settings_are_one_line_errors(kw: dict, match: str) -> None:
    with pytest.raises(VeilError, match=match) as e:
        create_defense("dpsgd", **kw)
    assert "\n" not in str(e.value)


def test_unknown_key_and_empty_trainable_and_unscheduled_target() -> None:
    with pytest.raises(VeilError, match="unknown config key 'defense.sigma'"):
        from_dict({"defense": {"name": "dpsgd", "sigma": 1.0}})
    model, b = _model("transformer4")
    with pytest.raises(VeilError, match="matches no trainable parameter"):
        DPSGD(noise_multiplier=1.0, trainable="no_such_param").attach(model)
    d = DPSGD(target_epsilon=3.0).attach(model)
    with pytest.raises(VeilError, match="needs the training schedule"):
        client_step(model, b, [d])


def test_the_report_states_epsilon() -> None:
    from pathlib import Path

    from veil.report.render import task_blocks

    priv = {
        "epsilon": 7.99,
        "delta": 1 / 8000,
        "accountant": "rdp",
        "noise_multiplier": 0.72,
        "sample_rate": 0.064,
        "steps": 80,
        "mode": "ghost",
    }
    t = {
        "model": "m",
        "data": "d",
        "protocol": "single-step",
        "dropout": 0.0,
        "knowledge": {},
        "samples": 1,
        "utility": {"dpsgd": {"test_accuracy_mean": 0.8, "test_accuracy_std": 0.0, "privacy": priv}},
        "leakage": {},
        "skipped": {},
        "blocked": {},
        "overhead": {},
        "step_seconds": {},
        "attacker_knows": {},
        "worst_case": {},
    }
    text = " ".join(b[1] for b in task_blocks("x", t, Path(".")) if b[0] == "p")
    assert "Privacy of `dpsgd`: epsilon = 7.99 at delta = 0.000125 (rdp accountant, noise multiplier 0.720" in text


class _Top(torch.nn.Module):
    """MiniLM's last layer + mean pooling + classifier, as veil's HFBert runs them, on the hidden
    states entering that layer."""

    def __init__(self, layer: torch.nn.Module, classifier: torch.nn.Module) -> None:
        super().__init__()
        self.layer, self.classifier = layer, classifier

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        from veil.models.base import padding_bias

        seq = self.layer(h, attention_mask=padding_bias(mask, causal=False, dtype=h.dtype))
        seq = seq[0] if isinstance(seq, tuple) else seq
        m = mask.unsqueeze(-1).to(seq.dtype)
        return self.classifier((seq * m).sum(1) / m.sum(1).clamp_min(1.0))


@pytest.mark.slow
def test_veils_dp_update_of_the_top_layer_is_opacus_ghost_clipping_on_that_layer() -> None:
    """veil's `dpsgd(trainable='layer\\.5\\.|classifier')` on the whole MiniLM gives the clipped update
    Opacus' own ghost clipping gives on MiniLM's last layer + head fed the hidden states entering it."""
    from opacus.grad_sample.grad_sample_module_fast_gradient_clipping import GradSampleModuleFastGradientClipping
    from opacus.optimizers import DPOptimizerFastGradientClipping
    from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

    torch.manual_seed(0)
    model = create_model("minilm", dropout=0.0, pooling="mean").train()
    b = batch_for(model, batch_size=6, seq_len=12)
    cap: dict[str, torch.Tensor] = {}
    hook = model.hf.bert.encoder.layer[5].register_forward_pre_hook(lambda m, a: cap.__setitem__("h", a[0].detach()))
    with torch.no_grad():
        model(b)
    hook.remove()
    d = DPSGD(clip=0.3, noise_multiplier=0.0, trainable=r"layer\.5\.|classifier").attach(model)
    veil = client_step(model, b, [d]).grads
    d.detach()
    import copy

    top = _Top(copy.deepcopy(model.hf.bert.encoder.layer[5]), copy.deepcopy(model.hf.classifier))
    gsm = GradSampleModuleFastGradientClipping(top, max_grad_norm=0.3, use_ghost_clipping=True)
    opt = DPOptimizerFastGradientClipping(
        torch.optim.SGD(top.parameters(), lr=0.0), noise_multiplier=0.0, max_grad_norm=0.3, expected_batch_size=6
    )
    crit = DPLossFastGradientClipping(gsm, opt, torch.nn.CrossEntropyLoss(), "mean")
    opt.zero_grad()
    crit(gsm(cap["h"], b["attention_mask"]), b["labels"]).backward()
    opt.pre_step()
    theirs = {
        "hf.bert.encoder.layer.5." + n[len("layer.") :] if n.startswith("layer.") else "hf." + n: p.grad
        for n, p in top.named_parameters()
    }
    assert set(theirs) == set(veil) and _flat(veil).norm() > 1e-3
    for k in veil:
        assert torch.allclose(veil[k], theirs[k], atol=1e-6), k


def test_default_noise_is_unknown_to_the_config_and_resume_never_replays() -> None:
    model, b = _model("hf-bert")
    draws = []
    for _ in range(2):  # no seed: each instance draws from its own OS-entropy seed
        d = DPSGD(clip=1.0, noise_multiplier=1.0, mode="ghost").attach(model)
        draws.append(_flat(client_step(model, b, [d]).grads))
        d.detach()
    assert not torch.allclose(draws[0], draws[1])
    d = DPSGD(clip=1.0, noise_multiplier=1.0, seed=3, mode="ghost").attach(model)
    run = [_flat(client_step(model, b, [d]).grads) for _ in range(3)]
    d.detach()
    d = DPSGD(clip=1.0, noise_multiplier=1.0, seed=3, mode="ghost").attach(model)
    d.resume(2)  # a run resumed after 2 steps continues with the third draw
    assert torch.allclose(_flat(client_step(model, b, [d]).grads), run[2], atol=1e-6) and d.steps == 3
    d.detach()


@pytest.mark.parametrize("name,mode", [("hf-bert", "ghost"), ("transformer4", "functorch"), ("gpt-tiny", "functorch")])
def test_length_grouped_micro_batches_keep_the_clipped_update_and_the_sample_order(name: str, mode: str) -> None:
    """Micro-batches sorted by length and cut to their longest sample give the clipped update of the
    whole padded batch, and the step's logits come back in the batch's order."""
    from veil.defenses.dpsgd_engines import micro_batches

    torch.manual_seed(0)
    model = create_model(name, **{**SMALL[name], "dropout": 0.0})
    model.eval()
    lengths = torch.tensor([9, 3, 12, 5, 7, 4, 11])
    ids = torch.randint(1000, 2000, (7, 16))
    mask = (torch.arange(16)[None] < lengths[:, None]).long()
    ids = ids * mask
    b = {"input_ids": ids, "attention_mask": mask, "labels": torch.arange(7) % 2}
    wide = {
        "input_ids": torch.nn.functional.pad(ids, (0, 9)),
        "attention_mask": torch.nn.functional.pad(mask, (0, 9)),
        "labels": b["labels"],
    }
    parts, order = micro_batches(b, 3)
    assert [p["input_ids"].shape[1] for p in parts] == [5, 11, 12] and order.tolist() == [1, 5, 3, 4, 0, 6, 2]
    out = {}
    for key, batch, chunk in (("grouped", b, 3), ("one", b, 7), ("wide", wide, 2)):
        d = DPSGD(
            clip=0.05, noise_multiplier=0.0, mode=mode, chunk=chunk, trainable=r"layer|block|classifier|head"
        ).attach(model)
        res = client_step(model, batch, [d])
        d.detach()
        out[key] = _flat(res.grads)
        if key == "grouped":
            with torch.no_grad():
                plain = model(batch)
            assert res.logits.shape == plain.shape
            real = mask.bool() if plain.dim() == 3 else slice(None)  # an LM's padding slots carry no logits
            assert torch.allclose(res.logits[real], plain[real], atol=1e-5)
    assert out["grouped"].norm() > 1e-3
    assert torch.allclose(out["grouped"], out["one"], atol=1e-6)
    assert torch.allclose(out["grouped"], out["wide"], atol=1e-6)
