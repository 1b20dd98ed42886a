"""p-FeSTA over a real SuperLink with two SuperNodes (processes on 127.0.0.1): the permutation keys
stay in each SuperNode's process. Every message a node received or sent (tapped as serialised
protobuf), the SuperLink's database and the server's run folder are searched for every key."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from flwr.common.serde import context_from_proto
from flwr.proto.message_pb2 import Context as ProtoContext  # type: ignore[attr-defined]

from veil.federated.cluster import LocalCluster

ROOT = Path(__file__).resolve().parent.parent
APP = ROOT / "scripts" / "deploy" / "split-app"
CONFIG = ROOT / "configs" / "split_deploy_pfesta.yaml"


def client_keys(tap: Path) -> list[np.ndarray]:
    """The permutation keys each client kept in its Context.state (train and test), as int64 rows."""
    out = []
    for f in tap.glob("context-*.bin"):
        proto = ProtoContext()
        proto.ParseFromString(f.read_bytes())
        state = context_from_proto(proto).state
        for name in ("keys", "test-keys"):
            if name in state.array_records:
                out.append(state[name].to_torch_state_dict()["keys"].numpy().astype(np.int64))
    return out


@pytest.mark.slow
def test_pfesta_over_a_superlink_keeps_every_key_on_its_supernode(tmp_path: Path) -> None:
    run, db = tmp_path / "run", tmp_path / "superlink.db"
    taps = [tmp_path / f"tap{i}" for i in range(2)]
    with LocalCluster(tmp_path / "c") as c:
        c.superlink(database=db)
        for i in range(2):
            c.supernode(i, f"partition-id={i}", tap=taps[i])
        assert c.submit(APP, {"config": str(CONFIG), "run-dir": str(run)}, timeout=900) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert set(summary["metrics"]) == {"classify", "segment"} and summary["permute"] is True
    keys = [k for t in taps for k in client_keys(t)]
    assert len(keys) == 4 and all(k.shape[1] == 16 for k in keys)  # train and test keys of both clients
    rows = {r.tobytes() for k in keys for r in k} | {r.astype(np.int32).tobytes() for k in keys for r in k}
    texts = {", ".join(map(str, r.tolist())) for k in keys for r in k}
    messages = [f for t in taps for f in t.iterdir() if f.suffix in (".in", ".out")]
    server_side = [f for f in run.rglob("*") if f.is_file()] + [db]
    assert len(messages) >= 8 and server_side
    for f in messages + server_side:
        data = f.read_bytes()
        assert not any(r in data for r in rows), f"a permutation key is in {f}"
        text = data.decode("latin-1")
        assert not any(t in text for t in texts), f"a permutation key is written out in {f}"
    assert not c.alive()
