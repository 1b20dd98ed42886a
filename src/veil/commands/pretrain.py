"""`veil pretrain CONFIG [key=value ...] --out DIR`: build a small pretrained checkpoint offline.

CONFIG is a run config without defenses (pretraining uses public data): its model is trained on
its data (a shipped source such as LFW or the AG News text) into ``DIR/run`` (resumable: run the
same command again after an interruption), then written as a checkpoint folder:
``DIR/model.safetensors`` and ``DIR/pretrained.json`` (the model's name and architecture, the
data it saw, its test metrics and the wall time). A later run starts from it with
``model: {name: NAME, init: DIR}`` (see `veil.models.pretrained`: the head is re-initialised when
the class count differs). Configs: ``configs/pretrain/``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from veil.commands import config_arguments, subcommand
from veil.errors import VeilError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = subcommand(
        sub, "pretrain", "pretrain a model on shipped data into a checkpoint folder (for model.init)", __doc__, run
    )
    config_arguments(
        p,
        "YAML run config (model, data, train; no defense)",
        "train.epochs=1",
        "checkpoint folder to write (a run folder DIR/run beside it)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    from veil.config import load_config
    from veil.runlock import hold

    cfg = load_config(args.config, args.overrides)
    if cfg.defense:
        raise VeilError(
            f"veil pretrain trains on public data without defenses; remove the config's defense "
            f"({', '.join(d['name'] for d in cfg.defense)})"
        )
    out = Path(args.out)
    with hold(out):
        meta = pretrain(cfg, out, progress=not args.quiet)
    print(json.dumps(meta, indent=2))
    return 0


def pretrain(cfg: object, out: Path, progress: bool = True) -> dict:
    """Train `cfg` into ``out/run`` and write the checkpoint folder `out`; returns its metadata."""
    from veil.build import load_run
    from veil.models.pretrained import META, save
    from veil.training.loop import train

    t0 = time.perf_counter()
    summary = train(cfg, out / "run", progress=progress)
    wall = time.perf_counter() - t0
    meta_file = out / META
    if meta_file.is_file() and (out / "run" / "summary.json").stat().st_mtime <= meta_file.stat().st_mtime:
        return json.loads(meta_file.read_text())  # written from this run already
    _, model, _, _ = load_run(out / "run")
    extra = {
        "data": dict(cfg.data),
        "train": {"epochs": cfg.train.epochs, "steps": summary.get("steps"), "seed": cfg.train.seed},
        "metrics": {k: v for k, v in summary.items() if k.startswith("test_")},
        "train_seconds": summary.get("train_seconds"),
        "wall_seconds": round(wall, 1),
        "params": summary.get("params"),
    }
    save(model, cfg.model["name"], out, extra)
    return json.loads(meta_file.read_text())
