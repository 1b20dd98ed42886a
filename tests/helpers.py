"""Small real inputs for tests: shapes each registered model accepts, and the tiny federated run
the FedAvg tests share."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from veil.assets import minilm_dir
from veil.models import VeilModel

if TYPE_CHECKING:
    import pytest

#: news-like sentences of at least 8 words (and one too short) for the multiple-choice QA tests
MC_TEXTS = [
    "the team won the final match of the season at home on sunday",
    "oil prices rose again as traders worried about supply in the gulf",
    "the new phone ships with a faster chip and a larger screen next month",
    "rain delayed the opening game of the series for three hours",
    "the central bank kept its key rate unchanged for the fourth time",
    "scientists found water ice near the south pole of the moon",
    "too short",
    "the company said profits fell sharply in the third quarter",
    "the striker scored twice as the club beat its old rivals",
]


#: a ViT-digits run that trains in about a second (overrides for `load_config(None, ...)`)
TINY_RUN = [
    "model=vit-digits",
    "model.depth=1",
    "model.dim=32",
    "model.heads=2",
    "data.train_size=256",
    "data.test_size=64",
    "train.epochs=2",
    "train.batch_size=64",
    "train.lr=0.003",
]


SMALL = {  # small widths so the whole registry runs in seconds
    "vit-digits": {},
    "vit-tiny": {"depth": 2},
    "transformer4": {"vocab_size": 30522},
    "bert-mini": {"depth": 2},
    "gpt-tiny": {"depth": 2},
    "minilm": {},
    "hf-bert": {"dim": 64, "depth": 2},
    "hf-vit": {"dim": 64, "depth": 2, "heads": 2},
    "hf-gpt2": {"dim": 64, "depth": 2},
    "resnet-tiny": {"image_size": 8, "in_chans": 1, "base_width": 8},
    "swin-tiny": {"image_size": 8, "in_chans": 1, "dim": 32},
    "llama-tiny": {"dim": 64, "depth": 2, "mlp_hidden": 96},
    "vit-seg": {"num_classes": 11, "depth": 2},
    "transformer4-mc": {"vocab_size": 30522, "num_classes": 4},
    "minilm-mc": {},
    # a user's checkpoint folder: the shipped MiniLM's (every family: tests/test_hf_path.py)
    "hf": {"path": str(minilm_dir())},
}


def batch_for(model: VeilModel, batch_size: int = 2, seq_len: int = 7) -> dict[str, torch.Tensor]:
    if model.modality == "image":
        cfg = getattr(model, "cfg", None)
        size = cfg.image_size if cfg else model.hf.config.image_size
        chans = cfg.in_chans if cfg else model.hf.config.num_channels
        if model.task == "segmentation":  # one label per pixel
            labels = torch.arange(batch_size * size * size).reshape(batch_size, size, size) % cfg.num_classes
            return {"pixels": torch.rand(batch_size, chans, size, size), "labels": labels}
        return {"pixels": torch.rand(batch_size, chans, size, size), "labels": torch.arange(batch_size) % 2}
    ids = torch.randint(1000, 2000, (batch_size, seq_len))
    ids[:, 0] = 101
    ids[:, -1] = 102
    mask = torch.ones_like(ids)
    ids[0, -2:] = 0
    ids[0, -3] = 102
    mask[0, -2:] = 0
    choices = getattr(model, "choices", None)
    if choices:  # multiple choice: every choice of every item, (batch, choices, length)
        ids, mask = ids.unsqueeze(1).repeat(1, choices, 1), mask.unsqueeze(1).repeat(1, choices, 1)
        ids[:, :, 1] = torch.arange(choices) + 1000  # the choices differ
        return {"input_ids": ids, "attention_mask": mask, "labels": torch.arange(batch_size) % choices}
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.arange(batch_size) % 2}


def kill_server_after_round(monkeypatch: pytest.MonkeyPatch, k: int) -> Callable[[], None]:
    """Make the federated server raise KeyboardInterrupt right after saving round `k`'s state (a
    killed server); returns the undo, to call before resuming."""
    from veil.federated.fedavg import server_app

    original = server_app.ServerState.save

    def crash_after_round(self: server_app.ServerState) -> None:
        original(self)
        if self.round == k:
            raise KeyboardInterrupt("server killed")

    monkeypatch.setattr(server_app.ServerState, "save", crash_after_round)
    return lambda: monkeypatch.setattr(server_app.ServerState, "save", original)


#: the FedAvg tests' model and run: a 1-layer width-16 ViT on 240 digits, in-process grid, no audit
FED_TINY = [
    "model.dim=16",
    "model.depth=1",
    "model.heads=2",
    "data.train_size=240",
    "data.test_size=100",
    "train.batch_size=16",
    "train.lr=0.003",
    "federated.backend=inline",
    "federated.audit=[]",
]


def fed_config(tmp: Path, federated: str) -> Path:
    """tmp/fed.yaml: vit-digits on digits (seed 0) with `federated` as its ``federated:`` mapping."""
    p = tmp / "fed.yaml"
    p.write_text(
        f"model: {{name: vit-digits}}\ndata: {{name: digits}}\ntrain: {{seed: 0}}\nfederated: {{{federated}}}\n"
    )
    return p


def events(run: Path) -> list[dict]:
    """The event log (metrics.jsonl) of a run folder."""
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def split_config(tmp: Path) -> Path:
    """A p-FeSTA split-learning config on digits (ViT, the permutation defense), written to `tmp`."""
    p = tmp / "split.yaml"
    p.write_text(
        "model: {name: vit-digits}\ndata: {name: digits}\ndefense: permutation\ntrain: {lr: 0.002, seed: 0}\n"
        "split: {protocol: pfesta}\n"
    )
    return p


def mark_and_sleep(folder: str, seconds: float) -> None:
    """A pool task that says which worker runs it (an empty file named by its pid), then waits:
    a worker running it has finished starting (its initializer ran)."""
    import os
    import time

    (Path(folder) / str(os.getpid())).touch()
    time.sleep(seconds)
