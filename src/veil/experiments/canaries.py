"""Canaries for one-run privacy auditing (Steinke, Nasr, Jagielski, NeurIPS 2023, "Privacy
Auditing with One (1) Training Run", Sec. 4 and 6), and the training run that carries them.

Each of m canaries joins the training set independently with probability 1/2; the run is veil's
own step (`veil.training.step.defended_backward`: the defenses' clipping, noise and transforms
act on canaries exactly as on data); afterwards the auditor scores every canary and
`veil.metrics.dp_audit.audit` turns the scores into epsilon-hat.

- White-box gradient canaries (Dirac canaries, Nasr et al., USENIX Security 2023, "Tight
  Auditing of Differentially Private Machine Learning", Sec. 3): canary i is a sample whose
  gradient is ``c e_{j_i}``, c the clipping norm C under DP-SGD (the largest a clipped sample may
  contribute), on a coordinate j_i of its own. It joins each batch as a sample does: under
  DP-SGD's Poisson sampling with probability q each step; without DP once per epoch, in a random
  step, weighted 1/B like the batch's samples in the mean loss. The auditor is the curious server
  that sees every exported update g_t (after every defense) and scores canary i by
  ``sum_t g_t[j_i]``. The coordinates lie in token-embedding rows of tokens no sample of the audit
  contains, so the data's gradient there is exactly zero and the score is signal plus the
  mechanism's noise; a model without such rows gets random coordinates (the data's gradient then
  adds to the noise: a weaker audit, never an invalid one). Where only a linear softmax head
  trains (DP fine-tuning of the classifier on a frozen encoder), canary j is the direction
  ``c (e_{1,j} + ... + e_{C,j}) / sqrt(C)`` across the C class rows of feature column j: every
  sample's gradient of a softmax cross-entropy there is ``(p - y) h^T`` with ``sum_c (p_c - y_c) = 0``,
  so it is orthogonal to every such direction and the data again add nothing to the score.
- Black-box input canaries: held-out samples with a wrong label (binary: the other class, else a
  random other class), scored by minus their loss on the released model (the final weights).

`canary_train` is the training loop of `veil.training.loop.train` (AdamW, warm-up + cosine,
Poisson batches under DP-SGD, the defense's accountant) with the canaries added.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from tqdm.auto import tqdm

from veil.config import RunConfig
from veil.data import iterate_batches
from veil.defenses.base import Defense
from veil.errors import VeilError
from veil.models.base import VeilModel
from veil.training.loop import evaluate, make_optimizer, poisson_batches, warmup_cosine
from veil.training.step import defended_backward


@dataclass
class GradientCanaries:
    """m gradient canaries: canary i is ``norm / sqrt(k)`` on each of the k flat coordinates
    ``index[i]`` of parameter ``names[param[i]]`` (k = 1: a Dirac canary)."""

    names: list[str]
    param: Tensor  # (m,) index into names
    index: Tensor  # (m, k) flat indices into that parameter
    included: Tensor  # (m,) bool
    norm: float = 1.0
    where: str = "random coordinates"

    @property
    def m(self) -> int:
        return len(self.index)


def unused_rows(model: VeilModel, splits: list[dict[str, Tensor]]) -> tuple[str, Tensor] | None:
    """The token-embedding table's name and the rows no sample of `splits` reads (None: no table)."""
    if not all("input_ids" in s for s in splits):
        return None
    table = getattr(model.token_embedding(), "weight", None)
    if not isinstance(table, torch.nn.Parameter) or table.dim() != 2 or not table.requires_grad:
        return None
    name = next((n for n, p in model.named_parameters() if p is table), None)
    if name is None:
        return None
    used = torch.zeros(table.shape[0], dtype=torch.bool)
    for s in splits:
        used[s["input_ids"].flatten().clamp(0, table.shape[0] - 1)] = True
    return name, (~used).nonzero()[:, 0]


def head_columns(model: VeilModel) -> tuple[str, Tensor] | None:
    """The classifier weight's name and, per feature column j, its flat indices in every class row
    (D, C), when only a linear softmax head trains; else None."""
    named = {n: p for n, p in model.named_parameters() if p.requires_grad}
    head = model.classifier()
    if model.task != "classification" or not isinstance(head, torch.nn.Linear) or head.out_features < 2:
        return None
    if {id(p) for p in named.values()} - {id(p) for p in head.parameters()}:
        return None
    name = next((n for n, p in named.items() if p is head.weight), None)
    if name is None:
        return None
    c, d = head.weight.shape
    return name, torch.arange(c)[None, :] * d + torch.arange(d)[:, None]


def gradient_canaries(
    model: VeilModel, splits: list[dict[str, Tensor]], m: int, norm: float, generator: torch.Generator
) -> GradientCanaries:
    """m gradient canaries on distinct coordinates (unused embedding rows, or the head's
    class-sum directions, when there are enough; else random Dirac ones), each included with
    probability 1/2."""
    named = {n: p for n, p in model.named_parameters() if p.requires_grad}
    if not named:
        raise VeilError("gradient canaries need a trainable parameter")
    rows = unused_rows(model, splits)
    cols = head_columns(model)
    if cols is not None and len(cols[1]) >= m:
        pick = torch.randperm(len(cols[1]), generator=generator)[:m]
        names, param, index = [cols[0]], torch.zeros(m, dtype=torch.long), cols[1][pick]
        where = "the head's class-sum directions"
    elif rows is not None and len(rows[1]) * named[rows[0]].shape[1] >= m:
        name, free = rows
        width = named[name].shape[1]
        cells = torch.randperm(len(free) * width, generator=generator)[:m]
        index = (free[cells // width] * width + cells % width)[:, None]
        names, param = [name], torch.zeros(m, dtype=torch.long)
        where = "unused embedding rows"
    else:
        names = list(named)
        sizes = torch.tensor([p.numel() for p in named.values()])
        if int(sizes.sum()) < m:
            raise VeilError(f"{m} gradient canaries need {m} coordinates; the model trains {int(sizes.sum())}")
        flat = torch.randperm(int(sizes.sum()), generator=generator)[:m]
        bounds = sizes.cumsum(0)
        param = torch.searchsorted(bounds, flat, right=True)
        index = (flat - torch.cat([torch.zeros(1, dtype=torch.long), bounds[:-1]])[param])[:, None]
        where = "random coordinates"
    included = torch.rand(m, generator=generator) < 0.5
    return GradientCanaries(names, param, index, included, float(norm), where)


def input_canaries(pool: dict[str, Tensor], num_classes: int, generator: torch.Generator) -> dict[str, Tensor]:
    """The pool's samples with a wrong label each, and ``included`` (probability 1/2 each)."""
    labels = pool["labels"]
    shift = torch.randint(1, max(num_classes, 2), labels.shape, generator=generator)
    out = {k: v.clone() for k, v in pool.items()}
    out["labels"] = (labels + shift) % max(num_classes, 2)
    out["included"] = torch.rand(len(labels), generator=generator) < 0.5
    return out


def _add(named: dict[str, torch.nn.Parameter], c: GradientCanaries, which: Tensor, weight: float) -> None:
    """Add ``weight * c e_j`` for the canaries `which` (bool, (m,)) into ``p.grad`` (the clipped sum)."""
    for k, name in enumerate(c.names):
        sel = which & (c.param == k)
        if not bool(sel.any()):
            continue
        p = named[name]
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        idx = c.index[sel].reshape(-1)
        step = weight * c.norm / math.sqrt(c.index.shape[1])
        p.grad.view(-1).index_add_(0, idx, torch.full((len(idx),), step, dtype=p.dtype, device=p.device))


def _read(named: dict[str, torch.nn.Parameter], c: GradientCanaries) -> Tensor:
    """Each canary's coordinate of the exported update (zero where a parameter got no gradient)."""
    out = torch.zeros(c.m, dtype=torch.float64)
    for k, name in enumerate(c.names):
        sel = c.param == k
        g = named[name].grad
        if g is not None:
            out[sel] = g.detach().view(-1)[c.index[sel]].double().sum(1).cpu() / math.sqrt(c.index.shape[1])
    return out


def canary_train(
    cfg: RunConfig,
    model: VeilModel,
    train_split: dict[str, Tensor],
    test_split: dict[str, Tensor],
    defenses: list[Defense],
    canaries: GradientCanaries | None = None,
    progress: bool = False,
) -> dict[str, Any]:
    """Train `model` on `train_split` under `defenses` as `veil train` does, with the gradient
    canaries; returns their scores (sum over steps of the exported update on each canary's
    coordinate), the steps, the test accuracy and the DP defense's accounting."""
    n, bs = len(train_split["labels"]), cfg.train.batch_size
    if not 1 <= bs <= n:
        raise VeilError(f"train.batch_size must be in [1, {n}] (the audit's training set), got {bs}")
    total = cfg.train.max_steps or cfg.train.epochs * math.ceil(n / bs)
    dp = [d for d in defenses if getattr(d, "poisson", False)]
    for d in dp:
        d.prepare(n, bs, total)
    opt = make_optimizer(model, cfg.train.lr, cfg.train.weight_decay, defenses)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(total, cfg.train.warmup))
    named = {nm: p for nm, p in model.named_parameters()}
    g = torch.Generator().manual_seed(cfg.train.seed * 100_003 + 7)
    scores = torch.zeros(canaries.m if canaries else 0, dtype=torch.float64)
    if canaries is not None:
        canaries.norm = dp[0].clip if dp else canaries.norm
    step, epoch = 0, 0
    bar = tqdm(total=total, disable=not progress, desc="train (canaries)", unit="step", leave=False)
    model.train()
    while step < total:
        torch.manual_seed(cfg.train.seed * 100_003 + epoch)
        if dp:
            batches = list(poisson_batches(train_split, bs, g))
        else:
            batches = list(iterate_batches(train_split, bs, shuffle=True, generator=g))
        slot = torch.randint(0, len(batches), (scores.numel(),), generator=g)  # without DP: one step an epoch
        for i, batch in enumerate(batches):
            if step >= total:
                break
            model.zero_grad(set_to_none=True)
            if canaries is not None:
                if dp:
                    which = canaries.included & (torch.rand(canaries.m, generator=g) < dp[0].sample_rate)
                    _add(named, canaries, which, 1.0)  # into the clipped sum: the mechanism divides and noises
                else:
                    _add(named, canaries, canaries.included & (slot == i), 1.0 / len(batch["labels"]))
            defended_backward(model, batch, defenses, step, cfg.train.clip or None)
            if canaries is not None:
                scores += _read(named, canaries)
            opt.step()
            sched.step()
            step += 1
            bar.update(1)
        epoch += 1
    bar.close()
    out: dict[str, Any] = {"scores": scores, "steps": step, "epochs": epoch}
    out.update(evaluate(model, test_split, cfg.train.eval_batch_size))
    if dp:
        out["privacy"] = dp[0].privacy(step)
    return out


@torch.no_grad()
def label_loss(model: VeilModel, split: dict[str, Tensor], batch_size: int = 256) -> Tensor:
    """Per-sample cross-entropy of `split`'s labels under `model` in eval mode (N,), float64."""
    was = model.training
    model.eval()
    out = []
    for batch in iterate_batches({k: v for k, v in split.items() if k != "included"}, batch_size):
        logits = model(batch)
        out.append(torch.nn.functional.cross_entropy(logits, batch["labels"], reduction="none").double())
    model.train(was)
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.float64)
