"""The defenses' formal guarantees as properties (hypothesis): each holds for every drawn input,
and each fails when its mechanism is switched off (the `*_fails_without_*` tests draw the same
inputs against the mechanism turned off and require the property to break).

* AEGIS channel 1: a frozen attention projection exports no gradient and the local step leaves
  it bit-identical, whatever the input.
* AEGIS channel 2: under the embedding noise of eq. (E), the row-norm statistic of present rows
  (tokens in the batch) is shifted from the absent rows' chi^2_D by at most 1 / embed_noise^2
  absent-row standard deviations — the level the defense states — tested two-sample over many
  noise draws.
* MJP: the output does not depend on the order of the tokens among the masked slots (they all
  carry E_unk), so the order, and with it the placement, is not recoverable from the output.
* p-FeSTA: no object the split-learning server holds carries the client's permutation key.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from veil.defenses import create_defense
from veil.models import create_model
from veil.training.loop import make_optimizer
from veil.training.step import client_step


@pytest.fixture(scope="module", autouse=True)
def _numpy_noise() -> Iterator[None]:
    """AEGIS's numpy noise path (the same draws to float32 rounding): no torch.compile in this file."""
    from veil.defenses import noise

    saved = dict(noise._GRAPH)
    noise._GRAPH["fn"] = None
    yield
    noise._GRAPH.clear()
    noise._GRAPH.update(saved)


FAST = settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
VOCAB = 300


def _text_batch(ids: list[list[int]], labels: list[int]) -> dict[str, torch.Tensor]:
    t = torch.tensor(ids)
    t[:, 0] = 101 % VOCAB
    return {"input_ids": t, "attention_mask": torch.ones_like(t), "labels": torch.tensor(labels)}


token_rows = st.integers(2, 3).flatmap(
    lambda b: st.tuples(
        st.lists(st.lists(st.integers(1, VOCAB - 1), min_size=6, max_size=6), min_size=b, max_size=b),
        st.lists(st.integers(0, 1), min_size=b, max_size=b),
    )
)


# ---- AEGIS channel 1 -------------------------------------------------------------------------------
def _channel1(freeze: bool, data: tuple, layer: int, proj: str, seed: int) -> tuple[bool, bool]:
    """(exported a gradient for the projection, the local step changed it)."""
    torch.manual_seed(seed)
    model = create_model("transformer4", vocab_size=VOCAB, max_len=8, dim=32, depth=2, heads=2)
    aegis = create_defense("aegis", freeze_attention=freeze, seed=seed)
    aegis.attach(model)
    weight = getattr(model.attention_layers()[layer], proj).weight
    before = weight.detach().clone()
    opt = make_optimizer(model, 0.05, 0.1, [aegis])
    name = next(n for n, p in model.named_parameters() if p is weight)
    res = client_step(model, _text_batch(*data), [aegis], optimizer=opt, step=0)
    return name in res.grads, not torch.equal(weight.detach(), before)


@FAST
@given(data=token_rows, layer=st.integers(0, 1), proj=st.sampled_from("qkvo"), seed=st.integers(0, 2**16))
def test_aegis_frozen_projection_exports_nothing_and_never_moves(data: tuple, layer: int, proj: str, seed: int) -> None:
    exported, moved = _channel1(True, data, layer, proj, seed)
    assert not exported and not moved


@FAST
@given(data=token_rows, layer=st.integers(0, 1), proj=st.sampled_from("qkvo"), seed=st.integers(0, 2**16))
def test_channel1_fails_without_freezing(data: tuple, layer: int, proj: str, seed: int) -> None:
    exported, moved = _channel1(False, data, layer, proj, seed)
    assert exported and moved


# ---- AEGIS channel 2 -------------------------------------------------------------------------------
DRAWS = 60


def _row_statistics(embed_noise: float, data: tuple, seed: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """||g_v||^2 / s_E^2 over DRAWS noise draws for present and absent rows, and D."""
    torch.manual_seed(seed)
    model = create_model("transformer4", vocab_size=VOCAB, max_len=8, dim=32, depth=1, heads=2)
    aegis = create_defense("aegis", freeze_attention=True, embed_noise=embed_noise, mlp_noise=0.0, seed=seed)
    aegis.attach(model)
    batch = _text_batch(*data)
    model.zero_grad(set_to_none=True)
    model.loss(model(batch), batch).backward()
    emb = model.token_embedding().weight
    clean = emb.grad.detach().clone()
    for p in model.parameters():
        if p is not emb:
            p.grad = None
    present = clean.norm(dim=1) > 0
    stats = []
    for step in range(DRAWS):
        emb.grad = clean.clone()
        aegis.transform_grads(model, step)
        std = (
            float(aegis.last_std["embedding"])
            if embed_noise > 0
            else float(clean.norm(dim=1).max()) / (2 * clean.shape[1]) ** 0.25
        )
        stats.append(emb.grad.pow(2).sum(1) / std**2)
    s = torch.stack(stats)  # (DRAWS, V)
    return s[:, present].reshape(-1).double(), s[:, ~present].reshape(-1).double(), clean.shape[1]


def _shift_z(present: torch.Tensor, absent: torch.Tensor, level: float, dim: int) -> float:
    """One-sided two-sample z of 'the present rows' mean exceeds the absent rows' by more than
    `level` absent-row standard deviations (sqrt(2D), the chi^2_D std)."""
    sd = math.sqrt(2 * dim)
    diff = (present.mean() - absent.mean()) / sd - level
    se = math.sqrt(float(present.var()) / len(present) + float(absent.var()) / len(absent)) / sd
    return float(diff / max(se, 1e-12))


def _ks(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """Two-sample Kolmogorov-Smirnov statistic and its critical value at alpha = 1e-3."""
    grid = torch.cat([a, b]).sort().values
    fa = torch.searchsorted(a.sort().values, grid, right=True) / len(a)
    fb = torch.searchsorted(b.sort().values, grid, right=True) / len(b)
    crit = math.sqrt(-0.5 * math.log(1e-3 / 2)) * math.sqrt((len(a) + len(b)) / (len(a) * len(b)))
    return float((fa - fb).abs().max()), crit


def _distinguishable(stats: tuple[torch.Tensor, torch.Tensor, int], level: float) -> bool:
    """Whether present and absent rows differ beyond `level`: the KS test rejects at 1e-3, or the
    mean shift exceeds the level at 4 sigma."""
    present, absent, dim = stats
    d, crit = _ks(present, absent)
    return d > crit or _shift_z(present, absent, level, dim) > 4.0


@FAST
@given(data=token_rows, embed_noise=st.floats(2.0, 5.0), seed=st.integers(0, 2**16))
def test_aegis_present_rows_are_within_the_stated_level(data: tuple, embed_noise: float, seed: int) -> None:
    stats = _row_statistics(embed_noise, data, seed)
    assert abs(float(stats[1].mean()) / stats[2] - 1) < 0.05  # absent rows are chi^2_D: the test is calibrated
    assert not _distinguishable(stats, 1 / embed_noise**2)


@FAST
@given(data=token_rows, seed=st.integers(0, 2**16))
def test_channel2_fails_without_the_noise(data: tuple, seed: int) -> None:
    assert _distinguishable(_row_statistics(0.0, data, seed), 1 / 3.0**2)  # clean rows against exact zeros


@FAST
@given(data=token_rows, seed=st.integers(0, 2**16))
def test_channel2_fails_at_a_weak_noise(data: tuple, seed: int) -> None:
    assert _distinguishable(_row_statistics(0.2, data, seed), 1 / 3.0**2)  # the default's level is exceeded


# ---- MJP: invariance to the order among masked slots ---------------------------------------------------
def _mjp_outputs(variant: str, model_name: str, seed: int, cut: int, perms: tuple) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(seed)
    opts = {"vit-digits": {"depth": 2}, "transformer4": {"vocab_size": VOCAB, "max_len": 10, "dim": 32, "depth": 2}}
    model = create_model(model_name, **opts[model_name]).eval()
    mjp = create_defense("mjp", gamma=0.5, variant=variant, aux="none", seed=seed)
    mjp.attach(model)
    mjp.set_eval_gamma(0.5)
    if model.modality == "image":
        batch = {"pixels": torch.rand(1, 1, 8, 8), "labels": torch.tensor([0])}
    else:
        batch = _text_batch([[int(v) for v in torch.randint(1, VOCAB, (10,))]], [0])
    n = model.movable(batch).shape[1]
    start = 1 if model.modality == "text" else 0  # [CLS] stays
    slots = torch.arange(start, n)[torch.randperm(n - start)[:cut]]
    mask = torch.zeros(1, n, dtype=torch.bool)
    mask[0, slots] = True
    outs = []
    for perm in perms:
        index = torch.arange(n)
        index[slots] = slots[torch.tensor(perm)]  # the tokens at the masked slots, in another order
        mjp.select = lambda movable, gamma, index=index: (mask, index[None])
        with torch.no_grad():
            outs.append(model(batch))
    return tuple(outs)


masked_orders = st.integers(3, 6).flatmap(
    lambda k: st.tuples(st.just(k), st.permutations(range(k)), st.permutations(range(k)))
)


@FAST
@given(model=st.sampled_from(["vit-digits", "transformer4"]), seed=st.integers(0, 2**16), orders=masked_orders)
def test_mjp_output_ignores_the_order_among_masked_slots(model: str, seed: int, orders: tuple) -> None:
    k, p1, p2 = orders
    a, b = _mjp_outputs("mjp", model, seed, k, (p1, p2))
    assert torch.allclose(a, b, atol=1e-5)


@FAST
@given(model=st.sampled_from(["vit-digits", "transformer4"]), seed=st.integers(0, 2**16), orders=masked_orders)
def test_mjp_invariance_fails_with_the_position_embeddings_kept(model: str, seed: int, orders: tuple) -> None:
    k, p1, _ = orders
    identity = tuple(range(k))
    if tuple(p1) == identity:
        p1 = identity[1:] + identity[:1]
    a, b = _mjp_outputs("shuffle", model, seed, k, (identity, p1))
    assert not torch.allclose(a, b, atol=1e-5)


# ---- p-FeSTA: the server never holds the key ---------------------------------------------------------
SPLIT_TINY = [
    "model.dim=16",
    "model.depth=1",
    "model.heads=2",
    "split.epochs=1",
    "split.clients_per_task=1",
    "split.tasks=[classify, segment]",
]


@pytest.fixture(scope="module")
def split_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("pfesta") / "split.yaml"
    path.write_text(
        "model: {name: vit-digits}\ndata: {name: digits}\n"
        "defense: permutation\ntrain: {lr: 0.002, seed: 0, batch_size: 32}\nsplit: {protocol: pfesta}\n"
    )
    return path


def _server_view(
    config: Path, seed: int, secret: str, enabled: bool
) -> tuple[dict[int, Any], dict[int, torch.Tensor], dict[int, Any]]:
    """One p-FeSTA upload (`train.embed`) over veil's in-process Flower grid: the reply the server
    receives (deserialised), and each client's keys and clean head features (the client side)."""
    from flwr.app import ConfigRecord, Message, RecordDict

    from veil.federated.grid import LocalGrid, exchange
    from veil.federated.split.client_app import app
    from veil.federated.split.multitask import build_parts, split_world
    from veil.federated.split.spec import load_split_spec

    extra = [f"train.seed={seed}", f"split.secret={secret}", f"defense.enabled={str(enabled).lower()}"]
    spec = load_split_spec(config, [*SPLIT_TINY, *extra])
    grid = LocalGrid(app, num_nodes=2)
    msgs = [
        Message(RecordDict({"config": ConfigRecord({"spec": spec.text()})}), dst_node_id=n, message_type="train.embed")
        for n in grid.nodes
    ]
    replies = exchange(grid, msgs, 600)
    world = split_world(spec.text())
    clean = {}
    for node, ctx in grid.nodes.items():
        task, data = world.clients[int(ctx.node_config["partition-id"])]
        head, _ = build_parts(world.spec, task)
        with torch.no_grad():
            clean[node] = head(data["pixels"])
    return {m.metadata.src_node_id: m for m in replies}, clean, grid.nodes


def key_leaks(replies: dict[int, Any], clean: dict[int, torch.Tensor], contexts: dict[int, Any]) -> list[str]:
    """What of the client's secret the server holds: a record named after a key, an array equal
    to a key (or its inverse), or head features in their own order. Empty: nothing. All three map
    a node id to its reply, its clean head features and its `Context` (the client side)."""
    from veil.defenses.permutation import unpermute

    found = []
    keys = {n: c.state["keys"].to_torch_state_dict()["keys"] for n, c in contexts.items() if "keys" in c.state}
    for m in replies.values():
        found += [f"record {name!r}" for name in m.content if "key" in name or "perm" in name]
        arrays = [v for rec in m.content.array_records.values() for v in rec.to_torch_state_dict().values()]
        for a in arrays:
            for k in keys.values():
                for form in (k, k.argsort(dim=1)):
                    if a.shape == form.shape and torch.equal(a.long(), form):
                        found.append("an array equal to a permutation key")
            for h in clean.values():
                if a.shape == h.shape and torch.allclose(a, h):
                    found.append("head features in their own order")
    if set(keys) != set(clean):
        found.append("a client kept no key (nothing was permuted)")
    for node, k in keys.items():
        sent = replies[node].content["features"].to_torch_state_dict()["x"]
        if not torch.allclose(unpermute(sent, k), clean[node], atol=1e-6):
            found.append("the features are not the client's, permuted by its own key")
    return found


@settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(seed=st.integers(0, 2**16), secret=st.sampled_from(["random", "seeded"]))
def test_pfesta_server_never_holds_the_key(split_config: Path, seed: int, secret: str) -> None:
    assert key_leaks(*_server_view(split_config, seed, secret, enabled=True)) == []


def test_pfesta_property_fails_without_the_permutation_or_with_a_leaky_reply(split_config: Path) -> None:
    replies, clean, contexts = _server_view(split_config, 0, "random", enabled=False)
    assert "head features in their own order" in key_leaks(replies, clean, contexts)
    replies, clean, contexts = _server_view(split_config, 0, "random", enabled=True)
    from flwr.app import ArrayRecord

    keys = next(iter(contexts.values())).state["keys"].to_torch_state_dict()["keys"]
    next(iter(replies.values())).content["aux"] = ArrayRecord({"x": keys})  # a client that ships its key
    assert "an array equal to a permutation key" in key_leaks(replies, clean, contexts)


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__, "-q"])
