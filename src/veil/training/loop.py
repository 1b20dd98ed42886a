"""The training loop: seeded, resumable, AdamW with warm-up and cosine decay, clipping.

Repeatability: epoch e shuffles with a generator seeded by (seed, e) and reseeds torch's global
RNG (dropout) the same way, so a run resumed from the checkpoint of epoch e continues exactly as
the uninterrupted run would have.

Differential privacy: with a defense that asks for it (``poisson = True``: DP-SGD), each step's
batch is a Poisson sample (every training sample independently with probability q =
batch_size / N; ceil(N / batch_size) steps an epoch), the defense learns the schedule
(``prepare``) before the first step, and its accountant's epsilon at delta is logged with every
epoch's evaluation (metrics.jsonl) and in summary.json (``privacy``).
"""

from __future__ import annotations

import json
import math
import sys
import time
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from tqdm.auto import tqdm

from veil.build import build_run
from veil.config import RunConfig, dump_config, same_config
from veil.data import DataSplits, iterate_batches
from veil.data.segmentation import confusion_matrix, segmentation_scores
from veil.defenses.base import Defense
from veil.errors import VeilError
from veil.io import append_events, atomic_write_text, intact, save_model_weights, truncate_events
from veil.models.base import Batch, VeilModel
from veil.runlock import holds_progress
from veil.runtime import use_threads
from veil.training.checkpoint import load_streams, load_training_state, save_training_state
from veil.training.frozen import feature_split
from veil.training.step import client_step


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise VeilError("train.device=cuda but no CUDA device is available; use auto or cpu")
    if name not in ("cpu", "cuda"):
        raise VeilError(f"train.device must be auto, cpu or cuda, got {name!r}")
    return torch.device(name)


def make_optimizer(
    model: VeilModel, lr: float, weight_decay: float, defenses: Sequence[Defense] = ()
) -> torch.optim.AdamW:
    """AdamW; no weight decay on biases, norms and embedding tables of rank < 2.

    Fused (one kernel for all parameters): the default for-loop AdamW issues many small ops per
    parameter tensor, which on small models costs more than the forward pass and makes every
    extra tensor a defense adds (MJP's E_unk and regressor) look expensive.
    """
    scale = {id(p): f for d in defenses for p, f in d.lr_scales(model)}
    groups: dict[tuple[bool, float], list[torch.nn.Parameter]] = {}
    for p in model.parameters():
        if p.requires_grad:
            groups.setdefault((p.ndim >= 2, scale.get(id(p), 1.0)), []).append(p)
    params = [
        {"params": ps, "weight_decay": weight_decay if decay else 0.0, "lr": lr * f}
        for (decay, f), ps in sorted(groups.items(), key=lambda kv: (not kv[0][0], -kv[0][1]))
    ]
    fused = all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for g in params for p in g["params"])
    return torch.optim.AdamW(params, lr=lr, fused=fused or None)


def warmup_cosine(total: int, warmup: float) -> Any:
    warm = max(1, int(total * warmup))

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warm) / max(1, total - warm))))

    return factor


def to_device(batch: Batch, device: torch.device) -> Batch:
    return {k: v.to(device) for k, v in batch.items()}


@torch.no_grad()
def evaluate(
    model: VeilModel, split: dict[str, Tensor], batch_size: int = 256, device: torch.device | str = "cpu"
) -> dict[str, float]:
    """Top-1 accuracy (classification), next-token accuracy and perplexity (LM), or pixel accuracy
    (as test_accuracy), mIoU and mAcc over one confusion matrix of every pixel (segmentation)."""
    was = model.training
    model.eval()
    correct, count, nll = 0.0, 0.0, 0.0
    confusion = None
    for batch in iterate_batches(split, batch_size, shuffle=False):
        batch = to_device(batch, device)
        logits = model(batch)
        if model.task == "segmentation":
            c = confusion_matrix(logits.argmax(1), batch["labels"], logits.shape[1]).cpu()
            confusion = c if confusion is None else confusion + c
        elif model.task == "lm":
            mask = batch["attention_mask"][:, 1:].bool()
            target = batch["input_ids"][:, 1:]
            lp = logits[:, :-1].log_softmax(-1)
            nll += float(-lp.gather(-1, target[..., None])[..., 0][mask].sum())
            correct += float((lp.argmax(-1) == target)[mask].sum())
            count += float(mask.sum())
        else:
            correct += float((logits.argmax(-1) == batch["labels"]).sum())
            count += len(batch["labels"])
    model.train(was)
    if confusion is not None:
        scores = segmentation_scores(confusion)
        return {
            "test_accuracy": scores["pixel_accuracy"],
            "test_miou": scores["miou"],
            "test_macc": scores["mean_accuracy"],
        }
    out = {"test_accuracy": correct / max(count, 1)}
    if model.task == "lm":
        out["test_perplexity"] = math.exp(nll / max(count, 1))
    return out


def _epoch_batches(split: dict[str, Tensor], cfg: RunConfig, epoch: int, poisson: bool = False) -> Iterator[Batch]:
    g = torch.Generator().manual_seed(cfg.train.seed * 100_003 + epoch)
    torch.manual_seed(cfg.train.seed * 100_003 + epoch)
    if poisson:
        return poisson_batches(split, cfg.train.batch_size, g)
    return iterate_batches(split, cfg.train.batch_size, shuffle=True, generator=g)


def poisson_batches(split: dict[str, Tensor], batch_size: int, generator: torch.Generator) -> Iterator[Batch]:
    """ceil(N / batch_size) batches, each sample in each batch independently with probability
    batch_size / N (Poisson sampling, which the DP accountant's subsampling bound assumes)."""
    n = len(next(iter(split.values())))
    q = batch_size / n
    for _ in range(math.ceil(n / batch_size)):
        idx = (torch.rand(n, generator=generator) < q).nonzero()[:, 0]
        yield {k: v[idx] for k, v in split.items()}


def _private(defenses: Sequence[Defense]) -> list[Any]:
    return [d for d in defenses if getattr(d, "poisson", False)]


def _privacy(defenses: Sequence[Defense], steps: int) -> dict[str, Any]:
    """The DP defense's accounting after `steps` steps ({} without one)."""
    dp = _private(defenses)
    return dp[0].privacy(steps) if dp else {}


def train(
    cfg: RunConfig,
    out_dir: str | Path,
    model: VeilModel | None = None,
    data: DataSplits | None = None,
    defenses: list[Defense] | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Train `cfg` into `out_dir`; resume from its checkpoint if one is there. Returns the summary."""
    out = Path(out_dir)
    if (
        (out / "config.yaml").is_file()
        and not same_config((out / "config.yaml").read_text(), cfg)
        and holds_progress(out)
    ):
        raise VeilError(f"run folder '{out}' holds a different config; pick a new --out or remove it")
    # (a folder with a config but nothing trained, from a run that failed before its first step, is taken over)
    done = _finished(out)
    if done is not None:
        return done
    if model is None:
        model, data, defenses = build_run(cfg, data)
    assert data is not None
    defenses = defenses or []
    device = pick_device(cfg.train.device)
    model.to(device)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "config.yaml", dump_config(cfg))

    steps_per_epoch = math.ceil(len(data.train["labels"]) / cfg.train.batch_size)
    total = cfg.train.max_steps or cfg.train.epochs * steps_per_epoch
    for d in _private(defenses):
        d.prepare(len(data.train["labels"]), cfg.train.batch_size, total)
    opt = make_optimizer(model, cfg.train.lr, cfg.train.weight_decay, defenses)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(total, cfg.train.warmup))
    loop = load_training_state(out / "checkpoints", model, opt) or {"epoch": 0, "step": 0, "seconds": 0.0}
    # threads round sums differently: a resumed run keeps the count its first part chose
    loop["threads"] = use_threads(loop.get("threads", cfg.train.threads))
    with warnings.catch_warnings():  # fast-forward the schedule to where the checkpoint left it
        warnings.simplefilter("ignore", UserWarning)
        for _ in range(loop["step"]):
            sched.step()
    truncate_events(out / "metrics.jsonl", "step", loop["step"])  # drop events past the checkpoint
    for d in _private(defenses):
        d.resume(loop["step"])
    if loop["step"]:
        restore_streams(defenses, load_streams(out / "checkpoints"))

    samples = data.train
    if cfg.train.frozen_features:  # the same samples, as the head sees them (one forward of the frozen encoder)
        samples = feature_split(model, data.train, defenses, cfg.train.eval_batch_size, device, progress)
    bar = tqdm(total=total, initial=loop["step"], disable=not progress, desc="train", unit="step", leave=False)
    model.train()
    while loop["step"] < total:  # one epoch per pass; max_steps may end one midway
        t0, events = time.perf_counter(), []
        for batch in _epoch_batches(samples, cfg, loop["epoch"], poisson=bool(_private(defenses))):
            if loop["step"] >= total:
                break
            res = client_step(
                model,
                to_device(batch, device),
                defenses,
                opt,
                step=loop["step"],
                clip=cfg.train.clip or None,
                export=False,
            )
            sched.step()
            loop["step"] += 1
            bar.update(1)
            bar.set_postfix(loss=f"{res.loss:.3f}")
            if loop["step"] % 10 == 0:
                events.append(
                    {
                        "event": "train",
                        "epoch": loop["epoch"],
                        "step": loop["step"],
                        "loss": res.loss,
                        "lr": sched.get_last_lr()[0],
                    }
                )
        loop["epoch"] += 1
        loop["seconds"] += time.perf_counter() - t0
        metrics = evaluate(model, data.test, cfg.train.eval_batch_size, device)
        privacy = _privacy(defenses, loop["step"])
        if privacy:
            metrics.update(epsilon=privacy["epsilon"], delta=privacy["delta"])
        events.append({"event": "eval", "epoch": loop["epoch"], "step": loop["step"], **metrics})
        append_events(out / "metrics.jsonl", events)
        save_training_state(out / "checkpoints", model, opt, loop, defense_streams(defenses))
    bar.close()
    return _finish(cfg, out, model, data, device, loop, _privacy(defenses, loop["step"]))


def defense_streams(defenses: Sequence[Defense]) -> dict[str, Tensor]:
    """Every defense's resume state, keyed `position.name.key` (two defenses of one kind stay apart)."""
    return {f"{i}.{d.name}.{k}": v for i, d in enumerate(defenses) for k, v in d.state_dict().items()}


def restore_streams(defenses: Sequence[Defense], streams: dict[str, Tensor]) -> None:
    """Hand each defense the state `defense_streams` saved for it."""
    for i, d in enumerate(defenses):
        prefix = f"{i}.{d.name}."
        d.load_state_dict({k[len(prefix) :]: v for k, v in streams.items() if k.startswith(prefix)})


def _finished(out: Path) -> dict[str, Any] | None:
    """The summary of a finished run in `out`, or None. A summary whose final weights fail their
    integrity check is not reused: the weights are rebuilt from the run's last checkpoint (itself
    checked; the same weights, one evaluation) by resuming past its last step."""
    path = out / "summary.json"
    if not path.is_file():
        return None
    model = out / "checkpoints" / "model.safetensors"
    if intact(model):
        return json.loads(path.read_text())
    if not (out / "checkpoints" / "state.json").is_file():
        raise VeilError(
            f"checkpoint '{model}' is missing or damaged and the run has no checkpoint to rebuild it from; remove '{out}' to retrain"
        )
    print(
        f"veil: checkpoint '{model}' fails its integrity check; rebuilding it from the run's last checkpoint",
        file=sys.stderr,
    )
    path.unlink()
    return None


def _finish(
    cfg: RunConfig,
    out: Path,
    model: VeilModel,
    data: DataSplits,
    device: torch.device,
    loop: dict[str, Any],
    privacy: dict[str, Any] | None = None,
) -> dict[str, Any]:
    save_model_weights(model, out / "checkpoints" / "model.safetensors")
    summary = {
        "model": cfg.model["name"],
        "data": cfg.data["name"],
        "defense": [d["name"] for d in cfg.defense] or ["none"],
        "params": sum(p.numel() for p in model.parameters()),
        "seed": cfg.train.seed,
        "epochs": loop["epoch"],
        "steps": loop["step"],
        "train_seconds": round(loop["seconds"], 3),
        **evaluate(model, data.test, cfg.train.eval_batch_size, device),
    }
    if privacy:
        summary["privacy"] = privacy
    atomic_write_text(out / "summary.json", json.dumps(summary, indent=2))
    return summary
