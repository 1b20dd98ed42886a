"""AEGIS: frozen attention, seeded per-step noise, bit-identity at zero strength, one masked gradient."""

from __future__ import annotations

import pytest
import torch

from veil.defenses import create_defense, list_defenses
from veil.defenses.aegis import attention_parameters
from veil.errors import VeilError
from veil.models import create_model
from veil.training.step import client_step

VOCAB = 300


def tiny(name: str = "transformer4", seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    kw = dict(vocab_size=VOCAB, dim=32, depth=2, heads=2)
    if name == "hf-gpt2":
        kw = dict(vocab_size=VOCAB, dim=32, depth=2, heads=2)
    return create_model(name, **kw)


def batch(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(103, VOCAB, (3, 10), generator=g)
    ids[:, 0] = 101
    mask = torch.ones_like(ids)
    mask[2, 7:] = 0
    ids[2, 7:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([0, 1, 1])}


def test_registered() -> None:
    assert {"aegis", "dpsgd", "prune", "gaussian"} <= set(list_defenses())


@pytest.mark.parametrize("name", ["transformer4", "gpt-tiny", "hf-gpt2"])
def test_frozen_attention_gets_no_update_and_exports_nothing(name: str) -> None:
    model = tiny(name)
    d = create_defense("aegis").attach(model)
    frozen = attention_parameters(model)
    names = {n for n, p in model.named_parameters() if any(p is q for q in frozen)}
    assert frozen and all(not p.requires_grad for p in frozen)
    before = [p.detach().clone() for p in frozen]
    from veil.training.loop import make_optimizer

    opt = make_optimizer(model, 1e-2, 0.05)
    res = client_step(model, batch(), [d], opt)
    assert names.isdisjoint(res.grads)  # nothing exported
    assert all(p.grad is None for p in frozen)
    assert all(torch.equal(a, p) for a, p in zip(before, frozen))  # no update
    d.detach()
    assert all(p.requires_grad for p in frozen)  # detach restores


@pytest.mark.parametrize("name", ["transformer4", "gpt-tiny"])
def test_zero_strength_is_bit_identical(name: str) -> None:
    m0, m1 = tiny(name), tiny(name)
    d = create_defense("aegis", freeze_attention=False, embed_noise=0.0, mlp_noise=0.0, mlp_down_noise=0.0).attach(m1)
    o0, o1 = torch.optim.AdamW(m0.parameters(), 1e-2), torch.optim.AdamW(m1.parameters(), 1e-2)
    for step in range(2):
        r0 = client_step(m0, batch(step), [], o0, step=step)
        r1 = client_step(m1, batch(step), [d], o1, step=step)
        assert r0.grads.keys() == r1.grads.keys()
        assert all(torch.equal(r0.grads[k], r1.grads[k]) for k in r0.grads)
    assert all(torch.equal(a, b) for a, b in zip(m0.parameters(), m1.parameters()))


def grads_of(defense_kw: dict, step: int, model_seed: int = 0, calls: int = 1) -> dict[str, torch.Tensor]:
    model = tiny(seed=model_seed)
    d = create_defense("aegis", **defense_kw).attach(model)
    for _ in range(calls):
        res = client_step(model, batch(), [d], step=step)
    return res.grads


def test_noise_is_seeded_and_changes_every_step() -> None:
    emb = "tok.weight"
    clean = grads_of(dict(embed_noise=0.0, mlp_noise=0.0, mlp_down_noise=0.0), 0)
    a = grads_of(dict(seed=1), 0)
    assert torch.equal(a[emb], grads_of(dict(seed=1), 0)[emb])  # same seed, same step -> same noise
    assert not torch.equal(a[emb], grads_of(dict(seed=2), 0)[emb])  # another seed
    assert not torch.equal(a[emb], grads_of(dict(seed=1), 1)[emb])  # another step
    assert not torch.equal(a[emb], grads_of(dict(seed=1), 0, calls=2)[emb])  # same step repeated: fresh noise
    # noise on EVERY row: absent vocabulary rows are no longer zero
    absent = torch.ones(VOCAB, dtype=torch.bool)
    absent[batch()["input_ids"].unique()] = False
    assert clean[emb][absent].abs().sum() == 0
    assert (a[emb][absent].norm(dim=1) > 0).all()
    up = "blocks.0.mlp.fc1.weight"
    assert not torch.equal(a[up], clean[up])
    assert not torch.equal(a["blocks.0.mlp.fc2.weight"], clean["blocks.0.mlp.fc2.weight"])  # the default noises fc2
    assert torch.equal(a["head.weight"], clean["head.weight"])  # other layers untouched


def test_embedding_noise_follows_its_calibration() -> None:
    model = tiny()
    d = create_defense("aegis", embed_noise=3.0, mlp_noise=0.0, freeze_attention=False).attach(model)
    clean = grads_of(dict(embed_noise=0.0, mlp_noise=0.0, freeze_attention=False), 0)["tok.weight"]
    noisy = client_step(model, batch(), [d]).grads["tok.weight"]
    rho_max = float(clean.norm(dim=1).max())
    want = 3.0 * rho_max / (2 * clean.shape[1]) ** 0.25
    assert d.last_std["embedding"] == pytest.approx(want, rel=1e-6)
    assert float((noisy - clean).std()) == pytest.approx(want, rel=0.05)


def test_masked_gradient_is_exported_and_drives_the_step() -> None:
    model = tiny()
    d = create_defense("aegis", seed=3).attach(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    res = client_step(model, batch(), [d], opt)
    for n, p in model.named_parameters():
        if n in res.grads:
            assert torch.equal(p.grad, res.grads[n])  # exported == what the optimiser holds
            assert torch.allclose(p.detach(), before[n] - 0.5 * res.grads[n], atol=1e-6)  # and used
    clean = grads_of(dict(embed_noise=0.0, mlp_noise=0.0), 0)
    assert not torch.equal(res.grads["tok.weight"], clean["tok.weight"])  # no clean gradient leaves


@pytest.mark.parametrize(
    "kw, msg",
    [
        (dict(embed_noise=-1), "embed_noise"),
        (dict(mlp_noise="a"), "mlp_noise"),
        (dict(freeze_attention="yes"), "freeze_attention"),
        (dict(seed=1.5), "seed"),
    ],
)
def test_bad_settings_are_one_line_errors(kw: dict, msg: str) -> None:
    with pytest.raises(VeilError, match=msg) as e:
        create_defense("aegis", **kw)
    assert "\n" not in str(e.value)


def test_attach_twice_and_wrong_modality() -> None:
    model = tiny()
    d = create_defense("aegis").attach(model)
    with pytest.raises(VeilError, match="already attached"):
        d.attach(model)
    with pytest.raises(VeilError, match="text"):
        create_defense("aegis").attach(create_model("vit-digits"))


# ---- adaptive attackers (veil.attacks.adaptive) ----------------------------------------------
def _attack(name: str, model, defenses, **kw):
    from veil.attacks import Knowledge, create_attack, observe

    obs = observe(model, batch(), defenses)
    know = Knowledge(batch_size=3, defense=defenses[0].describe() if defenses else {}, **kw.pop("know", {}))
    return create_attack(name, **kw).reconstruct(obs, know)


def _truth() -> set[int]:
    b = batch()
    return set(b["input_ids"][b["attention_mask"].bool()].tolist()) - {0, 101, 102}


def test_presence_adaptive_recovers_undefended_and_fails_under_aegis() -> None:
    from veil.metrics.text import presence

    enc, dec = tiny(), tiny("gpt-tiny")
    dec.eval()
    assert presence(_truth(), _attack("presence-adaptive", enc, []).token_set)["presence_f1"] == 1.0
    assert presence(_truth(), _attack("presence-adaptive", dec, [], source="head").token_set)["presence_f1"] > 0.9
    for model, src in ((enc, "embedding"), (dec, "embedding"), (dec, "head")):
        d = create_defense("aegis").attach(model)
        assert presence(_truth(), _attack("presence-adaptive", model, [d], source=src).token_set)["presence_f1"] < 0.2
        d.detach()


def test_presence_average_needs_rounds_and_averages_them() -> None:
    from veil.attacks import Knowledge, create_attack
    from veil.attacks.adaptive import observe_rounds

    model = tiny()
    d = create_defense("aegis", embed_noise=0.05).attach(model)  # weak noise: averaging must help
    obs = observe_rounds(model, batch(), [d], 8)
    att = create_attack("presence-average")
    with pytest.raises(VeilError, match="rounds"):
        att.reconstruct(obs[0], Knowledge())
    rec = att.reconstruct(obs[0], Knowledge(aux_data={"rounds": [o.grads for o in obs[1:]]}, defense=d.describe()))
    one = create_attack("presence-adaptive").reconstruct(obs[0], Knowledge(defense=d.describe()))
    # 12 noise seeds: one round finds 0-2 of the 24 tokens, eight rounds 14-19 (precision >= 0.85)
    truth = _truth()
    assert len(one.token_set & truth) < 0.2 * len(truth)
    assert rec.stats["rounds"] == 8 and len(rec.token_set & truth) > 0.55 * len(truth)
    assert len(rec.token_set & truth) > 0.8 * len(rec.token_set)


def test_the_harness_hands_presence_average_its_rounds_and_scores_presence_against_chance() -> None:
    """In an audit cell the server sees the client export the batch `rounds` times: the harness
    makes the other R - 1 exports (fresh noise each), so the attack runs as in the test above; the
    score carries the F1 of as many random guesses (2 m K / (V (m + K)), hand-computed here)."""
    from types import SimpleNamespace

    from veil.attacks import create_attack
    from veil.attacks.harness import attack_once, score

    model = tiny()
    d = create_defense("aegis", embed_noise=0.05).attach(model)
    tok = SimpleNamespace(vocab_size=VOCAB, cls_id=101, sep_id=102, pad_id=0)
    data = SimpleNamespace(meta={"tokenizer": tok, "special_ids": [0, 101, 102]})
    data.test = batch()
    rec, ref, _ = attack_once(create_attack("presence-average", rounds=8), model, batch(), [d], data, "original", 0)
    assert rec.stats["rounds"] == 8
    s = score(rec, ref, data)
    m, k = len(_truth()), len(rec.token_set - {0, 101, 102})
    assert s["presence_guesses"] == k
    assert s["presence_random_f1"] == pytest.approx(2 * m * k / (VOCAB * (m + k)))
    assert s["presence_f1"] > 10 * s["presence_random_f1"]
    with pytest.raises(VeilError, match="rounds' must be at least 2"):
        create_attack("presence-average", rounds=1)


def test_span_unfrozen_finds_decoder_first_tokens_unless_mlp_down_is_noised() -> None:
    model = tiny("gpt-tiny")
    model.eval()
    first = set(batch()["input_ids"][:, 1].tolist())
    from types import SimpleNamespace

    know = {"tokenizer": SimpleNamespace(cls_id=101, sep_id=102, pad_id=0)}
    d = create_defense("aegis", mlp_down_noise=0.0).attach(model)  # AEGIS as published
    rec = _attack("span-unfrozen", model, [d], know=dict(know))
    assert rec.stats["layers"]["mlp_up.0"]["passed"] == 0  # channel 3 closed
    assert first <= rec.token_set  # the MLP down-projection still leaks
    d.detach()
    d = create_defense("aegis").attach(model)  # the default noises it on a causal model
    assert d.describe()["mlp_down_noise"] == 1.0
    assert not (first & _attack("span-unfrozen", model, [d], know=dict(know)).token_set)


@pytest.mark.parametrize("name", ["transformer4", "gpt-tiny", "hf-gpt2"])
def test_mlp_down_noise_defaults_to_one_on_encoders_and_decoders(name: str) -> None:
    """The down-projection's gradient spans the MLP activations on every model (`span-down`
    rebuilds encoder sentences from it too), so the default closes that channel everywhere."""
    model = tiny(name)
    d = create_defense("aegis").attach(model)
    down = {id(p) for m in model.mlp_down() for p in m.parameters()}
    assert d.mlp_down_noise == 1.0
    assert down <= {id(p) for p in d.noised_parameters(model)}
    d.detach()
    d = create_defense("aegis", mlp_down_noise=0.0).attach(model)  # as published
    assert not down & {id(p) for p in d.noised_parameters(model)}
    d.detach()
    assert create_defense("aegis", mlp_down_noise=0.5).attach(model).mlp_down_noise == 0.5


def test_weights_only_freeze_leaves_the_attention_biases_training() -> None:
    model = tiny()
    d = create_defense("aegis", freeze_attention_bias=False).attach(model)
    weights, every = attention_parameters(model, biases=False), attention_parameters(model)
    biases = [p for p in every if all(p is not w for w in weights)]
    assert weights and biases and all(not p.requires_grad for p in weights) and all(p.requires_grad for p in biases)
    res = client_step(model, batch(), [d])
    exported = {id(p) for n, p in model.named_parameters() if n in res.grads}
    assert all(id(p) in exported for p in biases) and not any(id(p) in exported for p in weights)
    with pytest.raises(VeilError, match="freeze_attention_bias must be true or false"):
        create_defense("aegis", freeze_attention_bias="no")


def test_clipping_sees_the_clean_gradient_not_the_noise() -> None:
    """The global clip acts before AEGIS: its noise must not shrink the parameters it leaves clean."""
    m0, m1 = tiny(), tiny()
    d = create_defense("aegis", freeze_attention=False, embed_noise=3.0, mlp_noise=0.0, mlp_down_noise=0.0).attach(m1)
    r0 = client_step(m0, batch(), [], clip=0.01)
    r1 = client_step(m1, batch(), [d], clip=0.01)
    emb = next(n for n, p in m1.named_parameters() if p is m1.token_embedding().weight)
    clean = [n for n in r0.grads if n != emb]
    assert clean and all(torch.equal(r0.grads[n], r1.grads[n]) for n in clean)
    assert not torch.equal(r0.grads[emb], r1.grads[emb])


def test_noised_lr_scales_only_the_noised_parameters() -> None:
    """noised_lr=0: the noised tables export their noisy gradient but the local step leaves them."""
    from veil.training.loop import make_optimizer

    model = tiny()
    d = create_defense("aegis", noised_lr=0.0).attach(model)
    noised = d.noised_parameters(model)
    ids = {id(p) for p in noised}
    assert id(model.token_embedding().weight) in ids and all(id(m.weight) in ids for m in model.mlp_up())
    opt = make_optimizer(model, 1e-2, 0.05, [d])
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    res = client_step(model, batch(), [d], opt)
    for n, p in model.named_parameters():
        if n in before:
            assert torch.equal(before[n], p) == (id(p) in ids), n
    emb = next(n for n, p in model.named_parameters() if p is model.token_embedding().weight)
    assert res.grads[emb].abs().min() > 0  # every row exported with noise
    with pytest.raises(VeilError, match="noised_lr"):
        create_defense("aegis", noised_lr=-1)


def test_lr_scale_is_the_same_run_at_a_larger_learning_rate() -> None:
    """lr_scale multiplies the local learning rate of everything that still trains (noised_lr on top)."""
    from veil.training.loop import make_optimizer

    runs = []
    for lr, kw in ((3e-3, {}), (1e-3, {"lr_scale": 3.0})):
        model = tiny()
        d = create_defense("aegis", **kw).attach(model)
        opt = make_optimizer(model, lr, 0.05, [d])
        for step in range(2):
            client_step(model, batch(step), [d], opt, step=step)
        runs.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-8) for a, b in zip(*runs))
    assert not all(torch.equal(a, b) for a, b in zip(runs[0], [p.detach() for p in tiny().parameters()]))
    model = tiny()
    d = create_defense("aegis", lr_scale=3.0, noised_lr=0.5).attach(model)
    factors = {id(p): f for p, f in d.lr_scales(model)}
    assert factors[id(model.token_embedding().weight)] == 1.5 and factors[id(model.classifier().weight)] == 3.0
    with pytest.raises(VeilError, match="lr_scale"):
        create_defense("aegis", lr_scale=float("nan"))


def test_standard_normal_is_box_muller_on_seeded_sfc64_bits() -> None:
    """The draw matches the documented transform computed by hand in float64, is N(0, 1), seeded, fresh per key."""
    import numpy as np

    from veil.defenses.noise import standard_normal

    n, key = 2 * 4099 + 1, (3, 7, 1)  # odd: the last pair's cosine half is cut
    z = standard_normal(n, key).double().numpy()
    m = (n + 1) // 2
    words = np.random.SFC64(np.random.SeedSequence(list(key))).random_raw(m).view(np.int32).astype(np.int64)
    u1 = ((words[:m] >> 9) + 2**22 + 0.5) / 2**23
    t = 2 * np.pi * words[m:] / 2**32
    r = np.sqrt(-2 * np.log(u1))
    want = np.concatenate([r * np.sin(t), r * np.cos(t)])[:n]
    assert np.allclose(z, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(standard_normal(n, key), torch.from_numpy(z).float())
    big = standard_normal(400_000, (0, 1, 2)).double()
    assert abs(float(big.mean())) < 0.005 and abs(float(big.std()) - 1) < 0.005
    assert abs(float(((big - big.mean()) ** 4).mean() / big.var() ** 2) - 3) < 0.05  # Gaussian kurtosis
    halves = torch.stack([big[:200_000], big[200_000:]])
    assert abs(float(torch.corrcoef(halves)[0, 1])) < 0.01
    other = standard_normal(400_000, (0, 2, 2)).double()
    assert abs(float(torch.corrcoef(torch.stack([big, other]))[0, 1])) < 0.01
    space = torch.empty(n + 1)
    assert standard_normal(n, key, out=space).data_ptr() == space.data_ptr()
    threads = torch.get_num_threads()
    try:  # the values depend on the key only, not on how many threads torch runs
        torch.set_num_threads(1)
        one = standard_normal(n, key)
        torch.set_num_threads(2)
        assert torch.equal(standard_normal(n, key), one)
    finally:
        torch.set_num_threads(threads)


def clean_tables() -> list[torch.Tensor]:
    """A vocabulary-like table, a matrix and a vector."""
    g = torch.Generator().manual_seed(5)
    return [torch.randn(301, 16, generator=g), torch.randn(24, 16, generator=g), torch.randn(24, generator=g)]


def noisy_tables(threads: int | None = None, compiled: bool = True) -> tuple[list[torch.Tensor], list[float]]:
    """`clean_tables` noised in place with key (4, 2, 0)."""
    from veil.defenses import noise
    from veil.defenses.aegis import frobenius, row_norm_max

    tables = clean_tables()
    saved, before = torch.get_num_threads(), noise._GRAPH.copy()
    try:
        if threads:
            torch.set_num_threads(threads)
        if not compiled:
            noise._GRAPH["fn"] = None
        stds = noise.noise_tables_(tables, [row_norm_max, frobenius, frobenius], [0.5, 2.0, 1.0], (4, 2, 0))
    finally:
        torch.set_num_threads(saved)
        noise._GRAPH.clear()
        noise._GRAPH.update(before)
    return tables, stds


def test_noise_tables_add_the_keyed_draw_scaled_by_the_clean_statistic() -> None:
    """Compiled (default) and numpy paths: T_j + s_j z_j with s_j from the clean table, z the key's draw."""
    from veil.defenses.noise import standard_normal

    clean = clean_tables()
    want_std = [0.5 * float(clean[0].norm(dim=1).max()), 2.0 * float(clean[1].norm()), float(clean[2].norm())]
    z = standard_normal(sum(t.numel() for t in clean), (4, 2, 0))
    want = [c + s * part.view_as(c) for c, s, part in zip(clean, want_std, z.split([t.numel() for t in clean]))]
    for compiled in (True, False):
        tables, stds = noisy_tables(compiled=compiled)
        assert stds == pytest.approx(want_std, rel=1e-6)
        assert all(torch.allclose(t, w, rtol=1e-5, atol=1e-5) for t, w in zip(tables, want))
    (fast, stds), slow = noisy_tables(), noisy_tables(compiled=False)[0]
    assert (
        max(float((a - b).abs().max()) / s for a, b, s in zip(fast, slow, stds)) < 1e-5
    )  # same bits: z apart by rounding


def test_compiled_noise_does_not_depend_on_the_thread_count() -> None:
    one = noisy_tables(threads=1)[0]
    for threads in (2, 3):
        assert all(torch.equal(a, b) for a, b in zip(noisy_tables(threads=threads)[0], one))


def test_noise_falls_back_to_numpy_without_a_compiler(tmp_path) -> None:
    """No working C++ compiler: one warning, then the numpy draw; no table is noised twice."""
    import os
    import subprocess
    import sys

    code = (
        "import warnings, torch; from tests.test_aegis import noisy_tables\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    t, _ = noisy_tables()\n"
        "print(sum('falls back to numpy' in str(x.message) for x in w))\n"
        "torch.save(t, {!r})".format(str(tmp_path / "t.pt"))
    )
    env = {**os.environ, "CXX": str(tmp_path / "no-such-g++"), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache")}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == "1"
    got = torch.load(tmp_path / "t.pt")
    assert all(torch.equal(a, b) for a, b in zip(got, noisy_tables(compiled=False)[0]))
