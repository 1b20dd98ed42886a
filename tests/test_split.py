"""Split learning (SL / FeSTA / p-FeSTA) over Flower messages: the permutation module's algebra,
that no key, permutation or private sample reaches the server, byte accounting, protocols."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers import split_config as cfg
from veil.defenses.permutation import PatchPermutation, fresh_keys, permute, unpermute
from veil.errors import VeilError
from veil.federated.split.spec import load_split_spec

TINY = [
    "model.dim=16",
    "model.depth=1",
    "model.heads=2",
    "train.batch_size=64",
    "split.epochs=1",
    "split.clients_per_task=1",
    "split.tasks=[classify, segment]",
]


def test_permutation_is_inverted_and_body_is_equivariant() -> None:
    from veil.federated.split.models import Body, Head
    from veil.models import create_model

    x = torch.randn(3, 16, 4)
    keys = fresh_keys(3, 16, torch.Generator().manual_seed(0))
    assert torch.equal(unpermute(permute(x, keys), keys), x)
    assert len({tuple(k.tolist()) for k in keys}) == 3  # a fresh key per sample
    vit = create_model("vit-digits").eval()
    head, body = Head(vit), Body(vit)
    px = torch.rand(2, 1, 8, 8)
    h = head(px)
    k = fresh_keys(2, h.shape[1], torch.Generator().manual_seed(1))
    out, out_p = body(h), body(permute(h, k))
    assert torch.allclose(out_p[:, 0], out[:, 0], atol=1e-5)  # [CLS] is invariant
    assert torch.allclose(unpermute(out_p[:, 1:], k), out[:, 1:], atol=1e-5)  # patches equivariant
    d = PatchPermutation(enabled=False)
    assert d.before_send(h, {}) is h  # zero strength: identity


def test_sincos_head_positions_are_fixed_row_major_and_permuted_with_the_patches() -> None:
    """split.head_pos=sincos: the head adds fixed 2-D sine-cosine embeddings (row in the first half
    of the features, column in the second, row-major like patchify), every position distinct; the
    permutation still moves them with their patches, and the body stays equivariant."""
    from veil.federated.split.models import Body, Head, sincos_2d
    from veil.models import create_model

    table = sincos_2d(4, 16)
    assert table.shape == (16, 16) and table.abs().max() <= 1
    rows, cols = table[:, :8].reshape(4, 4, 8), table[:, 8:].reshape(4, 4, 8)
    assert torch.equal(rows, rows[:, :1].expand(4, 4, 8)) and torch.equal(cols, cols[:1].expand(4, 4, 8))
    assert torch.cdist(table, table).add(torch.eye(16) * 9).min() > 0.1  # 16 distinct positions
    vit = create_model("vit-digits").eval()
    head, body = Head(vit, "sincos"), Body(vit)
    assert torch.equal(head.pos.detach(), sincos_2d(vit.grid, vit.width))
    assert torch.equal(head.proj.weight, vit.patch_embed.weight)  # the projection is the model's
    h = head(torch.rand(2, 1, 8, 8))
    k = fresh_keys(2, h.shape[1], torch.Generator().manual_seed(1))
    out, out_p = body(h), body(permute(h, k))
    assert torch.allclose(out_p[:, 0], out[:, 0], atol=1e-5)
    assert torch.allclose(unpermute(out_p[:, 1:], k), out[:, 1:], atol=1e-5)
    with pytest.raises(VeilError, match="split.head_pos must be one of"):
        Head(vit, "rope")


def test_head_pos_reaches_every_client_and_is_validated(tmp_path: Path) -> None:
    from veil.federated.split.models import sincos_2d
    from veil.federated.split.multitask import build_parts

    spec = load_split_spec(cfg(tmp_path), ["split.head_pos=sincos"])
    a, _ = build_parts(spec, "classify")
    b, _ = build_parts(spec, "segment")
    assert torch.equal(a.pos, b.pos) and torch.equal(a.pos.detach(), sincos_2d(4, a.pos.shape[1]))
    learned, _ = build_parts(load_split_spec(cfg(tmp_path)), "classify")
    assert not torch.equal(learned.pos, a.pos) and torch.equal(learned.proj.weight, a.proj.weight)
    assert "head_pos: sincos" in spec.text() and "head_pos" not in load_split_spec(cfg(tmp_path)).text()
    with pytest.raises(VeilError, match="split.head_pos must be one of"):
        load_split_spec(cfg(tmp_path), ["split.head_pos=learned"])


def _spy_run(tmp: Path, monkeypatch: pytest.MonkeyPatch, *overrides: str) -> tuple[dict, list, list]:
    """Run split learning on the in-process grid, recording every message that reaches the server
    and every object the server holds."""
    from veil.federated import grid as grid_mod
    from veil.federated.split import server_app as split_mod
    from veil.federated.split.run import run_split

    up: list = []
    real_deliver = grid_mod.LocalGrid._deliver

    def deliver(self, msg, timeout):  # type: ignore[no-untyped-def]
        reply = real_deliver(self, msg, timeout)
        up.append(reply)
        spy_contexts[:] = list(self.nodes.values())
        return reply

    servers: list = []
    real_init = split_mod.SplitServer.__init__

    def init(self, *a, **k):  # type: ignore[no-untyped-def]
        real_init(self, *a, **k)
        servers.append(self)

    spy_contexts: list = []
    monkeypatch.setattr(grid_mod.LocalGrid, "_deliver", deliver)
    monkeypatch.setattr(split_mod.SplitServer, "__init__", init)
    summary = run_split(load_split_spec(cfg(tmp), [*TINY, *overrides]), tmp / "run")
    return summary, up, [servers[0], spy_contexts]


def _tensors(obj: object, seen: set | None = None, depth: int = 0) -> list[torch.Tensor]:
    """Every tensor reachable from a server-side object (attributes, dicts, lists, modules)."""
    seen = seen if seen is not None else set()
    if id(obj) in seen or depth > 6:
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, torch.nn.Module):
        return [t for t in obj.state_dict().values()]
    items = (
        obj.values()
        if isinstance(obj, dict)
        else obj
        if isinstance(obj, (list, tuple))
        else getattr(obj, "__dict__", {}).values()
    )
    out: list[torch.Tensor] = []
    for v in items:
        if type(v).__module__.startswith(("veil", "torch", "builtins")) or isinstance(v, (dict, list, tuple)):
            out += _tensors(v, seen, depth + 1)
    return out


def test_no_key_permutation_or_private_batch_reaches_the_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    summary, up, (server, contexts) = _spy_run(tmp_path, monkeypatch)
    # the clients' secrets: their permutation keys (only in Context.state) and their raw data
    keys = [c.state["keys"].to_torch_state_dict()["keys"] for c in contexts]
    from veil.federated.split.multitask import split_world

    world = split_world(server.spec.text())  # the clients' side (same process in simulation)
    private = [d["pixels"] for _, d in world.clients] + [d["target"] for _, d in world.clients]
    # 1. no reply to the server names or carries a key
    arrays = []
    for m in up:
        assert not any("key" in name for name in m.content)
        for rec in m.content.array_records.values():
            arrays += [v for v in rec.to_torch_state_dict().values()]
    assert arrays
    for a in arrays:
        for k in keys:
            assert not (a.shape == k.shape and torch.equal(a.long(), k)), "a permutation key left the client"
        for p in private:  # no raw pixels/targets of any client (any batch of them) in a message
            flat = p.reshape(len(p), -1).float()
            if a.dim() >= 2 and a.reshape(len(a), -1).shape[1] == flat.shape[1]:
                rows = a.reshape(len(a), -1).float()
                assert not any(bool((r == flat).all(1).any()) for r in rows), "a private sample left the client"
    # 2. the server holds no key and no private sample
    held = _tensors(server)
    assert held and not any(isinstance(v, type(world)) for v in vars(server).values())
    for t in held:
        for k in keys:
            assert not (t.shape == k.shape and torch.equal(t, k))
        for p in private:
            assert not (t.shape == p.shape and torch.equal(t, p))
    # 3. what the server cached is permuted: per sample a re-ordering of the head features, not them
    from veil.federated.split.multitask import build_parts

    head, _ = build_parts(world.spec, "classify")
    emb = next(
        m
        for m in up
        if "features" in m.content and m.content["features"]["x"].shape[0] == len(world.clients[0][1]["target"])
    )
    sent = emb.content["features"].to_torch_state_dict()["x"]
    with torch.no_grad():
        clean = head(world.clients[0][1]["pixels"])
    assert not torch.allclose(sent, clean)
    assert torch.allclose(unpermute(sent, keys[0]), clean, atol=1e-6)
    assert set(summary["metrics"]) == {"classify", "segment"}


@pytest.mark.parametrize("mode", ["random", "seeded"])
def test_server_cannot_rederive_the_permutation_keys_unless_secrets_are_seeded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """The server knows the seed, each client's id and how many batches it asked for: with the
    default client-held secret that does not give it the keys; with `split.secret: seeded` it does."""
    _, _, (_, contexts) = _spy_run(tmp_path, monkeypatch, f"split.secret={mode}")
    rederived = []
    for c in contexts:
        keys = c.state["keys"].to_torch_state_dict()["keys"]
        calls, pid = int(c.state["perm-calls"]["n"]), int(c.node_config["partition-id"])
        seed = 0 * 1009 + pid  # train.seed * 1009 + pid, as the client seeds its PatchPermutation
        rederived.append(
            any(
                torch.equal(
                    fresh_keys(keys.shape[0], keys.shape[1], torch.Generator().manual_seed(seed * 1_000_003 + n)), keys
                )
                for n in range(calls)
            )
        )  # any of the client's calls so far
    assert len(rederived) == 2 and all(rederived) == (mode == "seeded") and any(rederived) == (mode == "seeded")


def test_permutation_costs_no_utility(tmp_path: Path) -> None:
    """Body equivariance: p-FeSTA with and without the permutation trains to the same metrics."""
    from veil.federated.split.run import run_split

    a = run_split(load_split_spec(cfg(tmp_path), TINY), tmp_path / "a")
    b = run_split(load_split_spec(cfg(tmp_path), [*TINY, "defense=none"]), tmp_path / "b")
    for t in a["metrics"]:
        assert a["metrics"][t] == pytest.approx(b["metrics"][t], abs=0.02)


def test_bytes_are_counted_per_message_and_pfesta_sends_less_than_sl(tmp_path: Path) -> None:
    from veil.federated.split.run import run_split

    pf = run_split(load_split_spec(cfg(tmp_path), TINY), tmp_path / "pf")
    sl = run_split(load_split_spec(cfg(tmp_path), [*TINY, "split.protocol=sl", "defense=none"]), tmp_path / "sl")
    assert pf["bytes"]["by_type"]["train.embed"]["messages"] == 2  # head features sent once per client
    assert "train.fwd" not in pf["bytes"]["by_type"] and sl["bytes"]["by_type"]["train.fwd"]["messages"] > 0
    assert pf["bytes_per_client"] < sl["bytes_per_client"]
    steps = pf["steps"]
    assert pf["bytes"]["by_type"]["train.tail"]["messages"] == 2 * steps


def test_fl_and_central_references_run(tmp_path: Path) -> None:
    from veil.federated.split.run import run_split

    fl = run_split(load_split_spec(cfg(tmp_path), [*TINY, "split.protocol=fl", "defense=none"]), tmp_path / "fl")
    ce = run_split(load_split_spec(cfg(tmp_path), [*TINY, "split.protocol=central", "defense=none"]), tmp_path / "ce")
    assert "train.local" in fl["bytes"]["by_type"] and set(ce["metrics"]) == {"classify", "segment"}
    assert 0 <= ce["metrics"]["segment"] <= 1


def test_bad_split_settings_are_one_line_errors(tmp_path: Path) -> None:
    with pytest.raises(VeilError, match="split.protocol must be one of"):
        load_split_spec(cfg(tmp_path), ["split.protocol=xyz"])
    with pytest.raises(VeilError, match="split.tasks must be"):
        load_split_spec(cfg(tmp_path), ["split.tasks=[depth]"])
    with pytest.raises(VeilError, match="unknown config key 'split.permute'"):  # the permutation is a defense now
        load_split_spec(cfg(tmp_path), ["split.permute=false"])


def test_the_permutation_is_a_feature_defense_of_pfesta_only(tmp_path: Path) -> None:
    """Split learning drives the permutation through the defense protocol: only under p-FeSTA, and
    no gradient defense (which would act on nothing here); on a model (`veil train`) it is refused."""
    with pytest.raises(VeilError, match="'permutation' is p-FeSTA's module: it needs split.protocol=pfesta, got sl"):
        load_split_spec(cfg(tmp_path), ["split.protocol=sl"])
    with pytest.raises(
        VeilError, match="defense 'mjp' does not act on split learning's features; allowed: permutation"
    ):
        load_split_spec(cfg(tmp_path), ["defense=mjp"])
    from veil.build import build_run
    from veil.config import from_dict

    run = from_dict({"model": {"name": "vit-digits"}, "data": {"name": "digits"}, "defense": "permutation"})
    with pytest.raises(VeilError, match="acts on split learning's features .* run it with veil split"):
        build_run(run)


def test_veil_train_refuses_the_permutation_with_one_line(tmp_path: Path) -> None:
    import subprocess
    import sys

    cfg_path = tmp_path / "t.yaml"
    cfg_path.write_text("model: {name: vit-digits}\ndata: {name: digits}\ndefense: permutation\ntrain: {epochs: 1}\n")
    r = subprocess.run(
        [sys.executable, "-m", "veil.cli", "train", str(cfg_path), "--out", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "defense 'permutation' acts on split learning's features" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_feature_inversion_loses_the_image_under_permutation(tmp_path: Path) -> None:
    """The server's decoder rebuilds the private batch from in-order head features; with the
    permutation module the same attack's PSNR falls by several dB."""
    from veil.federated.split.feature_audit import feature_attacks

    spec = load_split_spec(cfg(tmp_path), ["model.dim=16", "model.depth=1", "model.heads=2"])
    res = feature_attacks(spec, victims=32, attacks={"feature_inversion": {"steps": 100, "hidden": 128, "lr": 3e-3}})
    fi = res["feature_inversion"]
    assert fi["plain"]["psnr"] > 15 and fi["psnr_drop_db"] > 3, fi


def test_adaptive_unshuffle_undoes_the_permutation_given_head_queries(tmp_path: Path) -> None:
    """Honest limit of the permutation module: an attacker who can query the frozen head puts
    every token back in its slot (affine subspace per slot), exactly."""
    from veil.attacks.features import unshuffle
    from veil.federated.split.multitask import build_parts

    spec = load_split_spec(cfg(tmp_path), [])
    head, _ = build_parts(spec, "classify")
    x = torch.rand(8, 1, 8, 8)
    with torch.no_grad():
        h = head(x)
    hp = PatchPermutation(True, seed=5).before_send(h, {})
    assert not torch.equal(hp, h)
    assert torch.equal(unshuffle(hp, head, (1, 8, 8)), h)
