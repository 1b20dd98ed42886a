"""SecAgg+ in veil's engine (`federated.secagg`): the server and its auditor hold only the sum of
the clients' updates; the aggregate equals plain FedAvg's within SecAgg+'s quantization bound;
SecAgg+ with Flower's client-side DP reports epsilon; the sparse-row attack reads every client's
tokens from the sum; bad options are one line."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from veil.errors import VeilError
from veil.federated.fedavg import secagg
from veil.federated.fedavg.task import load_spec

sys.path.insert(0, str(Path(__file__).parent))
from helpers import FED_TINY, fed_config  # noqa: E402

TEXT = """model: {{name: transformer4, dim: 32, depth: 1, heads: 2}}
data: {{name: sst2, tokenizer: word, max_len: 16, train_size: 400, test_size: 50}}
train: {{batch_size: 4, lr: 0.003, seed: 0}}
federated: {{clients: {n}, rounds: 1, partition: iid, local_steps: 2, mode: {mode}, backend: inline,
  audit: [presence, sparse-rows, labels], audit_clients: {n}}}
"""


def run(tmp: Path, out: str, *overrides: str, clients: int = 3) -> dict[str, Any]:
    from veil.federated.fedavg.runner import federate

    torch.set_num_threads(1)
    cfg = fed_config(tmp, f"clients: {clients}, rounds: 1, partition: iid, local_steps: 2")
    return federate(load_spec(cfg, [*FED_TINY, *overrides]), tmp / out)


def events(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln]


def test_no_server_side_object_holds_an_individual_update(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every message the server receives carries no array; each masked vector is uncorrelated with
    the client's update; the auditor never builds a per-client view and attacks one view, the
    aggregate, which is the weighted mean of the clients' updates."""
    from veil.federated.fedavg.auditor import Auditor
    from veil.federated.grid import LocalGrid

    sent: dict[int, tuple[int, dict[str, np.ndarray]]] = {}  # node -> (weight, its plaintext update), client side
    bridge = secagg._bridge

    def tap(call_next: Any) -> Any:
        inner = bridge(call_next)

        def handle(msg: Any, ctx: Any) -> Any:
            reply = inner(msg, ctx)
            res = secagg.compat.recorddict_to_fitres(reply.content, keep_input=True)
            names = reply.content[secagg.NAMES_KEY]["names"]
            arrays = dict(zip(names, secagg.parameters_to_ndarrays(res.parameters), strict=True))
            sent[msg.metadata.dst_node_id] = (res.num_examples, arrays)
            return reply

        return handle

    monkeypatch.setattr(secagg, "_bridge", tap)
    received: list[Any] = []  # every reply the server's Grid hands it
    real = LocalGrid.send_and_receive

    def spy(self: LocalGrid, messages: Any, *, timeout: float | None = None) -> Any:
        replies = list(real(self, messages, timeout=timeout))
        received.extend(replies)
        return replies

    monkeypatch.setattr(LocalGrid, "send_and_receive", spy)

    def refuse(*a: Any, **k: Any) -> Any:
        raise AssertionError("the auditor built a per-client view under SecAgg+")

    for name in ("audit", "observation", "pseudo_gradient", "record"):
        monkeypatch.setattr(Auditor, name, refuse)
    views: list[Any] = []
    real_run = Auditor.run

    def run_spy(self: Auditor, attack: Any, obs: Any, ev: dict, score: Any) -> dict:
        views.append((ev["client"], {k: v.clone() for k, v in obs.grads.items()}))
        return real_run(self, attack, obs, ev, score)

    monkeypatch.setattr(Auditor, "run", run_spy)
    run(tmp_path, "sa", "federated.secagg={}", "federated.audit=[labels]", "federated.audit_clients=3")

    assert len(sent) == 3 and received
    for msg in received:
        assert not msg.has_error()
        assert all(len(rec) == 0 for rec in msg.content.array_records.values())  # no array reached the server
    masked = {
        m.metadata.src_node_id: m.content.config_records["secaggplus_configs"]["masked_params"]
        for m in received
        if "masked_params" in m.content.config_records.get("secaggplus_configs", {})
    }
    assert set(masked) == set(sent)
    from flwr.common import bytes_to_ndarray

    vecs, upds = [], []
    for node, blobs in masked.items():
        vecs.append(np.concatenate([bytes_to_ndarray(b).ravel() for b in blobs[1:]]).astype(np.float64))
        upds.append(np.concatenate([a.ravel() for a in sent[node][1].values()]))
        # the masked vector says nothing of the update: its correlation is that of independent vectors,
        # whose spread is 1 / sqrt(n) (5 of those: a false alarm once in ~2 million; an unmasked vector gives ~1)
        assert abs(np.corrcoef(vecs[-1], upds[-1])[0, 1]) < 5 / np.sqrt(len(upds[-1]))
    # the fixed 0.05 bound, on every client's values together (n large enough that 0.05 is over 4 spreads)
    assert abs(np.corrcoef(np.concatenate(vecs), np.concatenate(upds))[0, 1]) < 0.05
    # the auditor saw one view, the aggregate, equal to the weighted mean of the updates
    assert [c for c, _ in views] == ["aggregate"]
    weights = np.array([w for w, _ in sent.values()], dtype=np.float64)
    final = load_file(str(tmp_path / "sa" / "checkpoints" / "model.safetensors"))
    mean = sum(w * np.concatenate([u[k].ravel() for k in final]) for w, u in sent.values()) / weights.sum()
    flat = np.concatenate([final[k].numpy().ravel() for k in final])
    assert np.abs(flat - mean).max() <= secagg.error_bound(secagg.DEFAULTS, weights)


def test_secagg_aggregate_equals_fedavg_within_the_quantization_bound(tmp_path: Path) -> None:
    run(tmp_path, "plain")
    run(tmp_path, "sa", "federated.secagg={}")
    a = load_file(str(tmp_path / "plain" / "checkpoints" / "model.safetensors"))
    b = load_file(str(tmp_path / "sa" / "checkpoints" / "model.safetensors"))
    sizes = [e for e in events(tmp_path / "sa") if e["event"] == "round"]
    assert sizes and sizes[0]["replies"] == 3
    diff = max(float((a[k] - b[k]).abs().max()) for k in a)
    # 3 clients of 80 samples each, 2 local steps of 16: num-examples 32 each (the bound needs only the weights)
    bound = secagg.error_bound(secagg.DEFAULTS, [32, 32, 32])
    assert 0.0 < diff <= bound, (diff, bound)


def test_secagg_with_flower_client_side_dp_reports_epsilon(tmp_path: Path) -> None:
    s = run(tmp_path, "dp", "federated.secagg={}", "federated.dp=client-fixed", "federated.dp_noise=1.0")
    assert s["dp"]["kind"] == "client-fixed" and s["dp"]["epsilon"] > 0
    rounds = [e for e in events(tmp_path / "dp") if e["event"] == "round"]
    assert rounds[0]["dp_released"] and rounds[0]["dp_epsilon"] == pytest.approx(s["dp"]["epsilon"])


@pytest.mark.parametrize("mode", ["fedavg", "fedsgd"])
def test_sparse_rows_reads_every_clients_tokens_from_the_sum(tmp_path: Path, mode: str) -> None:
    from veil.federated.fedavg.runner import federate

    torch.set_num_threads(1)
    (tmp_path / "c.yaml").write_text(TEXT.format(n=3, mode=mode))
    federate(load_spec(tmp_path / "c.yaml", ["federated.secagg={}"]), tmp_path / "run")
    got = {e["attack"]: e for e in events(tmp_path / "run") if e["event"] == "audit"}
    assert got["sparse-rows"]["client"] == "aggregate" and got["sparse-rows"]["batch"] == 24 // (
        2 if mode == "fedsgd" else 1
    )
    assert got["sparse-rows"]["presence_f1"] == 1.0
    assert got["sparse-rows"]["server_saw"] == "the aggregate of 3 clients (SecAgg+)"


@pytest.mark.parametrize(
    ("override", "says"),
    [
        ("federated.secagg={shares: 3}", "has no option 'shares'"),
        ("federated.secagg={num_shares: 3, reconstruction_threshold: 3}", "must be less than"),
        ("federated.secagg={clipping_range: -1}", "must be a positive number"),
        ("federated.dp=server-fixed", "clips on the server"),
        ("federated.clients=1", "at least 2 clients per round"),
    ],
)
def test_bad_secagg_settings_are_one_line(tmp_path: Path, override: str, says: str) -> None:
    cfg = fed_config(tmp_path, "clients: 3, rounds: 1")
    with pytest.raises(VeilError, match=says) as e:
        load_spec(cfg, [*FED_TINY, "federated.secagg={}", override])
    assert "\n" not in str(e.value)


def test_without_secagg_the_spec_text_has_no_secagg_key(tmp_path: Path) -> None:
    cfg = fed_config(tmp_path, "clients: 3, rounds: 1")
    assert "secagg" not in load_spec(cfg, FED_TINY).text()
    assert "quantization_range: 4194304" in load_spec(cfg, [*FED_TINY, "federated.secagg=true"]).text()


def test_sparse_rows_removes_weight_decay_and_clears_the_noise_floor() -> None:
    from veil.attacks.presence import present_tokens
    from veil.attacks.sparse_rows import decay_free_rows, used_rows

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(200, 16, generator=gen)
    g = 0.01 * w  # AdamW's decay alone moves every row along its weights
    used = [3, 17, 42, 150]
    g[used] += torch.randn(4, 16, generator=gen)
    g += 1e-5 * torch.randn(200, 16, generator=gen)  # SecAgg+'s quantization error on every entry
    assert len(present_tokens(g.norm(dim=1))) == 200  # the naive row-norm test takes every row
    found = used_rows(decay_free_rows(g, w).norm(dim=1), z=8.0, rel_tol=1e-6)
    assert sorted(found.tolist()) == used


def test_veil_audit_with_secagg_reports_the_aggregate_as_the_threat_model(tmp_path: Path) -> None:
    from veil.commands.audit import audit as run_audit
    from veil.experiments.scenario import parse_scenario

    torch.set_num_threads(1)
    raw = {
        "name": "sa",
        "seeds": [0],
        "tasks": [
            {
                "name": "avg",
                "protocol": "fedavg",
                "run": {
                    "model": {"name": "vit-digits", "dim": 16, "depth": 1, "heads": 2},
                    "data": {"name": "digits", "train_size": 120, "test_size": 50},
                    "train": {"batch_size": 4, "lr": 0.003, "seed": 0},
                },
                "attacks": ["labels"],
                "federated": {"clients": 3, "rounds": 1, "local_steps": 1, "audit_clients": 3, "secagg": {}},
            }
        ],
    }
    s = run_audit(parse_scenario(raw), tmp_path / "out", progress=False)
    assert s["tasks"]["avg"]["server_saw"] == ["the aggregate of 3 clients (SecAgg+)"]
    assert s["tasks"]["avg"]["federated"]["secagg"]["quantization_range"] == 4194304
    report = (tmp_path / "out" / "report.md").read_text()
    assert "the server holds no individual update" in report and "the aggregate of 3 clients (SecAgg+)" in report
