"""Exact resume for split learning: each side checkpoints what it holds, nothing more.

A split run's state is split too. The server holds the body, its Adam state, the loop position,
p-FeSTA's sampling stream and its cache of (permuted) head features; each client holds its head,
tail, their Adam states and its permutation keys with their draw counter, all in Flower's
`Context.state` (`veil.federated.split.client_app`). So every `split.checkpoint_every` steps the
server asks each client to write its `Context.state` to the client's own `state-dir` (its node
config; `veil split` gives each in-process client RUN_DIR/clients/clientN, a SuperNode names its
own on its machine), and only once every client has confirmed does it write its own checkpoint,
`state.json` last (what marks it complete). On resume the server restores its side and tells each
client the step to restore; a client that has no intact snapshot of that step for this spec fails
with one line. The keys never leave the client: they go to the client's folder, not into a
message or the server's checkpoint (`tests/test_split.py`, `tests/test_split_resume.py`).

Files are safetensors with a SHA-256 beside each (`veil.io`), like `veil train`'s checkpoints.
Each side also saves its torch RNG state (dropout), so the resumed steps draw what they would have.
A client keeps its last two snapshots: the server's newest checkpoint is always one of them.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, RecordDict

from veil.errors import VeilError
from veil.io import intact, load_tensors, save_tensors, write_checked_text
from veil.training.checkpoint import load_group, read_state, save_checkpoint

RNG = "__torch_rng__"


def spec_hash(spec_text: str) -> str:
    return hashlib.sha256(spec_text.encode()).hexdigest()[:16]


# ---- the client's side: Context.state <-> STATE_DIR/step-S.{safetensors,json} ------------------
def _stem(state_dir: Path, step: int) -> Path:
    return state_dir / f"step-{step:08d}"


def save_client_state(state: RecordDict, state_dir: Path, step: int, spec_text: str) -> None:
    """Write a client's `Context.state` (every array and config record) as the snapshot of `step`."""
    state_dir.mkdir(parents=True, exist_ok=True)
    tensors = {
        f"{name}/{k}": v.detach().contiguous().clone()
        for name, rec in state.array_records.items()
        for k, v in rec.to_torch_state_dict().items()
    }
    tensors[RNG] = torch.get_rng_state()
    configs = {name: dict(rec) for name, rec in state.config_records.items()}
    stem = _stem(state_dir, step)
    save_tensors(tensors, stem.with_suffix(".safetensors"))
    meta = {"step": step, "spec": spec_hash(spec_text), "arrays": list(state.array_records), "configs": configs}
    write_checked_text(stem.with_suffix(".json"), json.dumps(meta))
    for old in sorted(state_dir.glob("step-*.json"))[:-2]:  # keep the newest two snapshots
        for f in (old, old.with_suffix(".safetensors")):
            for p in (f, f.with_name(f.name + ".sha256")):
                p.unlink(missing_ok=True)


def load_client_state(state_dir: Path, step: int, spec_text: str) -> RecordDict:
    """The `Context.state` a client saved at `step` (its torch RNG restored); one line if missing."""
    stem = _stem(state_dir, step)
    meta_path = stem.with_suffix(".json")
    remedy = "remove the server's checkpoints/ folder to restart the run from its first step"
    if not intact(meta_path):
        raise VeilError(f"this client has no intact snapshot of step {step} in '{state_dir}'; {remedy}")
    meta = json.loads(meta_path.read_text())
    if meta.get("spec") != spec_hash(spec_text):
        raise VeilError(f"the client snapshot '{meta_path}' belongs to a different run config; {remedy}")
    tensors = load_tensors(stem.with_suffix(".safetensors"), remedy)
    torch.set_rng_state(tensors.pop(RNG))
    out = RecordDict()
    for name in meta["arrays"]:
        prefix = name + "/"
        out[name] = ArrayRecord({k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)})
    for name, values in meta["configs"].items():
        out[name] = ConfigRecord(values)
    return out


# ---- the server's side: RUN_DIR/checkpoints/ ------------------------------------------------------
def save_server_state(ckdir: Path, tensors: dict[str, dict[str, torch.Tensor]], state: dict[str, Any]) -> None:
    """One safetensors file per group of tensors (body, optimiser, cache, ...), then `state.json`
    naming the groups (which vary with the protocol), published as one set (`save_checkpoint`)."""
    save_checkpoint(ckdir, {**state, "groups": sorted(tensors)}, tensors)


def load_server_state(ckdir: Path) -> tuple[dict[str, Any], dict[str, dict[str, torch.Tensor]]] | None:
    """`state.json` and its tensor groups, or None when there is no complete checkpoint."""
    state = read_state(ckdir, "groups")
    if state is None:
        return None
    return state, {g: load_group(ckdir, g) for g in state["groups"]}


def rng_to_json(state: tuple[Any, ...]) -> list[Any]:
    """`random.Random.getstate()` as JSON (version, 625 words, gauss)."""
    version, words, gauss = state
    return [version, list(words), gauss]


def rng_from_json(data: list[Any]) -> tuple[Any, ...]:
    return (int(data[0]), tuple(int(w) for w in data[1]), data[2])
