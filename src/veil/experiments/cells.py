"""One audit cell: attack the client updates of a trained run and score what comes back.

The attack sees only the `Observation` (the exported gradients and the weights the server
sent) and the granted `Knowledge`; the private batch is used afterwards, here, to score.
"""
from __future__ import annotations

import statistics
import time
from typing import Any

import torch
from torch import Tensor

from veil.attacks import Attack, Knowledge, Reconstruction, create_attack, observe
from veil.data import DataSplits, subset
from veil.defenses.base import Defense
from veil.metrics import image_report, presence, text_report
from veil.models.base import VeilModel

SPECIAL_TOKENS = {"[CLS]", "[SEP]", "[PAD]"}


def pick_batch(split: dict[str, Tensor], batch_size: int, seed: int, sample: int) -> dict[str, Tensor]:
    """A seeded batch of the client's private data (sample k of the cell)."""
    g = torch.Generator().manual_seed(seed * 7919 + sample)
    n = len(split["labels"])
    idx = torch.randperm(n, generator=g)[:batch_size]
    return subset(split, idx.numpy())


def knowledge_for(task_knowledge: dict[str, Any], batch: dict[str, Tensor], data: DataSplits, defenses: list[Defense], seed: int) -> Knowledge:
    B = len(batch["labels"])
    know = Knowledge(batch_size=B if task_knowledge.get("batch_size", True) else None, seed=seed, tokenizer=data.meta.get("tokenizer"))
    if task_knowledge.get("labels", False):
        know.labels = batch["labels"].clone()
    if "pixels" in batch:
        know.input_shape = tuple(batch["pixels"].shape[1:])
    else:
        know.seq_len = int(batch["attention_mask"].sum(1).max()) if task_knowledge.get("seq_len", True) else None
        know.input_shape = (int(batch["input_ids"].shape[1]),)
    if task_knowledge.get("defense", True):
        know.defense = {d.name: d.describe() for d in defenses}
    return know


def _tokens(tokenizer: Any, ids: list[int]) -> list[str]:
    return list(tokenizer.decode(ids)) if tokenizer is not None else [str(i) for i in ids]


def true_sequences(batch: dict[str, Tensor]) -> list[list[int]]:
    mask = batch["attention_mask"].bool()
    return [row[m].tolist() for row, m in zip(batch["input_ids"], mask)]


def score(rec: Reconstruction, batch: dict[str, Tensor], model: VeilModel, tokenizer: Any) -> tuple[dict[str, float], dict[str, Any]]:
    """Metrics of one reconstruction against the private batch, plus an example to show."""
    metrics: dict[str, float] = {}
    example: dict[str, Any] = {}
    if rec.images is not None:
        rep = image_report(batch["pixels"], rec.images.detach().clamp(0, 1))
        metrics.update({k: float(v) for k, v in rep.items() if k != "order"})
        example = {"original": batch["pixels"][:4].tolist(), "reconstruction": rec.images.detach().clamp(0, 1)[:4].tolist()}
    if rec.token_ids is not None:
        refs = [_tokens(tokenizer, s) for s in true_sequences(batch)]
        hyps = [_tokens(tokenizer, s) for s in rec.token_ids]
        rep = text_report(refs, hyps, ignore=SPECIAL_TOKENS)
        order = rep.pop("order")
        metrics.update({k: float(v) for k, v in rep.items()})
        example = {"references": refs[:4], "reconstructions": [hyps[j] if j >= 0 else [] for j in order[:4]]}
    if rec.token_set is not None:
        from veil.attacks.presence import special_ids, true_token_set

        truth = true_token_set(batch["input_ids"], batch["attention_mask"], drop=special_ids(model, tokenizer))
        metrics.update(presence(truth, set(rec.token_set)))
    if rec.labels is not None and "labels" in batch:
        t = sorted(batch["labels"].tolist())
        p = sorted(rec.labels.tolist())
        hits = sum(min(t.count(c), p.count(c)) for c in set(t))
        metrics["label_accuracy"] = hits / max(len(t), 1)
    for k in ("iterations", "iterations_per_second"):
        if isinstance(rec.stats.get(k), (int, float)):
            metrics[k] = float(rec.stats[k])
    metrics["seconds"] = float(rec.stats.get("seconds", 0.0))
    return metrics, example


def run_cell(attack: Attack, model: VeilModel, data: DataSplits, defenses: list[Defense], knowledge: dict[str, Any],
             samples: int, seed: int) -> dict[str, Any]:
    """Attack `samples` client steps of one trained run; mean of every metric, first example kept."""
    batch_size = int(knowledge.get("batch_size", 1)) if not isinstance(knowledge.get("batch_size"), bool) else 1
    model.train()  # the client trains: defenses such as MJP act in training mode, dropout as configured
    rows, example = [], None
    for k in range(samples):
        batch = pick_batch(data.test, batch_size, seed, k)
        obs = observe(model, batch, defenses, step=k)
        know = knowledge_for(knowledge, batch, data, defenses, seed * 1000 + k)
        torch.manual_seed(seed * 1000 + k)
        rec = attack.reconstruct(obs, know)
        metrics, ex = score(rec, batch, model, data.meta.get("tokenizer"))
        rows.append(metrics)
        example = example or ex
    keys = sorted(set().union(*rows))
    out = {k: statistics.fmean(r[k] for r in rows if k in r) for k in keys}
    out["samples"] = samples
    out["batch_size"] = batch_size
    return {"metrics": out, "example": example}


def step_overhead(models: dict[str, tuple[VeilModel, list[Defense]]], batch: dict[str, Tensor], repeats: int = 7) -> dict[str, float]:
    """Median seconds of one client step (forward, backward, defense, export) per defense, interleaved in one run (ratios are what count)."""
    from veil.training.step import client_step

    times: dict[str, list[float]] = {k: [] for k in models}
    for r in range(repeats + 1):
        for k, (m, ds) in models.items():
            m.train()
            t0 = time.perf_counter()
            client_step(m, batch, ds, None, step=r, clip=1.0, export=True)  # no optimiser: weights stay
            if r:  # the first round warms up
                times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def make_attack(entry: dict[str, Any]) -> Attack:
    return create_attack(entry["name"], **{k: v for k, v in entry.items() if k != "name"})
