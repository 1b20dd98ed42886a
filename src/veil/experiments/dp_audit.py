"""The `dp-audit` protocol of `veil audit`: check a defense's privacy claim empirically, in one
training run per (defense, seed), and measure membership inference on the released model.

A task with ``protocol: dp-audit`` (its options under ``canaries``, `OPTIONS`) trains each of its
defenses once on the task's data with canaries (`veil.experiments.canaries`):

- white-box gradient canaries (Dirac canaries, read in every exported update: the curious
  server's view) and black-box input canaries (mislabelled samples, read from the released
  model's loss), each included with probability 1/2; epsilon-hat with its confidence from
  Steinke, Nasr, Jagielski (NeurIPS 2023) one-run bound (`veil.metrics.dp_audit`), at the run's
  delta (DP-SGD with a finite epsilon) or ``canaries.delta`` (a defense that claims no finite
  epsilon: MJP, AEGIS, none, DP-SGD without noise);
- the claimed epsilon is the run's accountant's (Opacus, `veil.defenses.dpsgd`); an epsilon-hat
  above it is flagged as a bug in the mechanism (`flagged`), not a privacy finding;
- membership inference on the trained model (`veil.attacks.membership`): the training samples
  (members) against held-out samples of the same split (non-members), the loss attack and, with
  ``canaries.references: K``, LiRA offline with K reference models trained as the target was
  (same defense) on random halves of the members and non-members; TPR at 0.1 % and 1 % FPR, AUC
  and the ROC's points (the report draws it on log axes).

The training split is partitioned with the seed: ``input`` samples for the input canaries, then
``nonmembers`` (a share of the rest) held out, the remainder are the members; the task's test
split gives the test accuracy. Each (defense, seed) result is a file (cells/TASK/DEFENSE/dp-audit/
seedN.json, hashed): a killed audit resumes without repeating it.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from veil.attacks.membership import confidence_logits, lira_offline, loss_scores
from veil.build import build_data, build_run
from veil.config import RunConfig
from veil.errors import VeilError
from veil.experiments.canaries import canary_train, gradient_canaries, input_canaries, label_loss
from veil.experiments.features import frozen_run
from veil.experiments.scenario import Scenario, Task, label
from veil.experiments.summary import task_entry
from veil.io import intact, write_checked_text
from veil.metrics.dp_audit import audit, flagged, max_epsilon
from veil.metrics.leakage import worst_case
from veil.metrics.membership import summarize
from veil.registry import PROTOCOLS

#: ``canaries`` options of a dp-audit task, with their defaults
OPTIONS: dict[str, Any] = {
    "gradient": 1000,  # white-box Dirac canaries (0: none)
    "input": 500,  # black-box mislabelled canaries, taken from the training split (0: none)
    "delta": 1e-5,  # the bound's delta for a defense that claims no epsilon
    "confidence": 0.95,
    "nonmembers": 0.5,  # share of the training split (after the input canaries) held out for MIA
    "references": 0,  # LiRA offline reference models per defense and seed (0: the loss attack only)
}


def options(task: Task) -> dict[str, Any]:
    """The task's ``canaries`` options over `OPTIONS`, checked (one line per bad key or value)."""
    raw = dict(task.canaries or {})
    bad = sorted(set(raw) - set(OPTIONS))
    if bad:
        raise VeilError(f"unknown key 'canaries.{bad[0]}' in task '{task.name}'; allowed: {', '.join(OPTIONS)}")
    o = {**OPTIONS, **raw}
    for k in ("gradient", "input", "references"):
        if isinstance(o[k], bool) or not isinstance(o[k], int) or o[k] < 0:
            raise VeilError(f"canaries.{k} must be an integer >= 0, got {o[k]!r}")
    for k, lo, hi in (("delta", 0.0, 1.0), ("confidence", 0.0, 1.0), ("nonmembers", 0.0, 1.0)):
        if isinstance(o[k], bool) or not isinstance(o[k], (int, float)) or not lo < o[k] < hi:
            raise VeilError(f"canaries.{k} must be a number in ({lo:g}, {hi:g}), got {o[k]!r}")
    if o["gradient"] == 0 and o["input"] == 0:
        raise VeilError(
            f"task '{task.name}': canaries.gradient and canaries.input are both 0; the audit needs canaries"
        )
    return o


def validate_task(task: Task, s: Scenario) -> None:
    o = options(task)
    if task.attacks:
        raise VeilError(f"task '{task.name}' (protocol dp-audit) runs its own canary audit; drop its attacks")
    data = build_data(task.run)
    if data.modality not in ("text", "image") or "labels" not in data.train or data.train["labels"].dim() != 1:
        raise VeilError(f"task '{task.name}': dp-audit needs a classification data set (one label per sample)")
    n = len(data.train["labels"]) - o["input"]
    held = int(round(n * o["nonmembers"]))
    if n - held < task.run.train.batch_size or held < 1:
        raise VeilError(
            f"task '{task.name}': {len(data.train['labels'])} training samples leave too few members or non-members "
            f"after {o['input']} input canaries (members {n - held}, non-members {held}, batch {task.run.train.batch_size})"
        )
    for d in task.defenses:
        build_run(task.run_for(d, s.seeds[0]), data)  # the defense's keys and that it attaches


def partition(n: int, o: dict[str, Any], seed: int) -> dict[str, Tensor]:
    """Indices of the training split: input-canary pool, non-members, members (seeded)."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 7919 + 11))
    pool, rest = perm[: o["input"]], perm[o["input"] :]
    held = int(round(len(rest) * o["nonmembers"]))
    return {"pool": pool, "nonmembers": rest[:held], "members": rest[held:]}


def _take(split: dict[str, Tensor], idx: Tensor) -> dict[str, Tensor]:
    return {k: v[idx] for k, v in split.items()}


def _cat(a: dict[str, Tensor], b: dict[str, Tensor]) -> dict[str, Tensor]:
    return {k: torch.cat([a[k], b[k]]) for k in a}


def build(cfg: RunConfig, data: Any, out: Path) -> tuple[Any, Any, list[Any]]:
    """The run's model, data and defenses; a ``train.frozen_features`` run gets both splits as the
    head sees them (the frozen encoder's features, computed once per audit: `frozen_run`)."""
    if cfg.train.frozen_features:
        return frozen_run(cfg, out / "features")
    return build_run(cfg, data)


def audit_one(
    task: Task, d: dict[str, Any], seed: int, o: dict[str, Any], confidence: float, data: Any, out: Path
) -> dict[str, Any]:
    """One (defense, seed): the canary run, both epsilon-hats, and membership inference."""
    cfg = task.run_for(d, seed)
    model, data, defenses = build(cfg, data, out)
    parts = partition(len(data.train["labels"]), o, seed)
    members, nonmembers = _take(data.train, parts["members"]), _take(data.train, parts["nonmembers"])
    g = torch.Generator().manual_seed(seed * 104_729 + 3)
    pool = input_canaries(_take(data.train, parts["pool"]), data.num_classes, g) if o["input"] else None
    every = [data.train, data.test]
    grad = gradient_canaries(model, every, o["gradient"], 1.0, g) if o["gradient"] else None
    train_split = members
    if pool is not None:
        train_split = _cat(members, _take({k: v for k, v in pool.items() if k != "included"}, pool["included"]))
    res = canary_train(cfg, model, train_split, data.test, defenses, grad)
    privacy = res.get("privacy") or {}
    claimed = privacy.get("epsilon")
    finite = claimed is not None and claimed != "inf"
    delta = float(privacy["delta"]) if finite else o["delta"]  # a claim is checked at its own delta
    row: dict[str, Any] = {
        "claimed_epsilon": claimed,
        "delta": delta,
        "confidence": confidence,
        "test_accuracy": res["test_accuracy"],
        "steps": res["steps"],
        "privacy": privacy,
    }
    if grad is not None:
        row["white_box"] = audit(res["scores"].numpy(), grad.included.numpy(), delta, confidence, seed)
        row["white_box"]["coordinates"] = grad.where
    if pool is not None:
        scores = -label_loss(model, pool, cfg.train.eval_batch_size)
        row["black_box"] = audit(scores.numpy(), pool["included"].numpy(), delta, confidence, seed)
    row["eps_hat"] = max(row.get(k, {}).get("eps_hat", 0.0) for k in ("white_box", "black_box"))
    row["flagged"] = flagged(row["eps_hat"], claimed)
    row["membership"] = membership(task, d, seed, o, data, model, members, nonmembers, out)
    return row


def membership(
    task: Task,
    d: dict[str, Any],
    seed: int,
    o: dict[str, Any],
    data: Any,
    target: Any,
    members: dict[str, Tensor],
    nonmembers: dict[str, Tensor],
    folder: Path,
) -> dict[str, Any]:
    """The loss attack and (with references) LiRA offline on members vs non-members."""
    candidates = _cat(members, nonmembers)
    n_in = len(members["labels"])
    phi = confidence_logits(target, candidates)
    out = {"loss": summarize(loss_scores(phi[:n_in]).numpy(), loss_scores(phi[n_in:]).numpy())}
    if o["references"]:
        ref_phi, trained_on = [], []
        g = torch.Generator().manual_seed(seed * 31_337 + 5)
        n = len(candidates["labels"])
        for k in range(o["references"]):
            pick = torch.randperm(n, generator=g)[:n_in]
            cfg = task.run_for(d, 10_000 + seed * 100 + k)  # the attacker's own training runs
            model, _, defenses = build(cfg, data, folder)
            canary_train(cfg, model, _take(candidates, pick), data.test, defenses)
            ref_phi.append(confidence_logits(model, candidates))
            mask = torch.zeros(n, dtype=torch.bool)
            mask[pick] = True
            trained_on.append(mask)
        lira = lira_offline(phi, torch.stack(ref_phi), torch.stack(trained_on))
        out["lira"] = summarize(lira[:n_in].numpy(), lira[n_in:].numpy())
        out["lira"]["references"] = o["references"]
    return out


def _cached(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.is_file() and intact(path) else None


def _claimed(rows: list[dict[str, Any]]) -> Any:
    vals = [r["claimed_epsilon"] for r in rows]
    if any(v is None for v in vals):
        return None
    return "inf" if any(v == "inf" for v in vals) else max(float(v) for v in vals)


def run_task(task: Task, s: Scenario, out: Path, progress: bool = False) -> dict[str, Any]:
    """Audit every (defense, seed); the task's summary entry with tables dp_audit and membership."""
    o = options(task)
    confidence = 1.0 - (1.0 - o["confidence"]) / len(s.seeds)  # max over seeds stays at the stated level
    data = build_data(task.run)
    t = task_entry(task, 0, about={"canaries": o}, tables=("dp_audit", "membership"))
    for d in task.defenses:
        rows = []
        for seed in s.seeds:
            path = out / "cells" / task.name / label(d) / "dp-audit" / f"seed{seed}.json"
            row = _cached(path)
            if row is None:
                if progress:
                    print(f"dp-audit: {task.name} / {label(d)} / seed {seed}", flush=True)
                row = audit_one(task, d, seed, o, confidence, data, out)
                path.parent.mkdir(parents=True, exist_ok=True)
                write_checked_text(path, json.dumps(row))
            rows.append(row)
        dn = label(d)
        acc = [r["test_accuracy"] for r in rows]
        t["utility"][dn] = {
            "test_accuracy_mean": statistics.fmean(acc),
            "test_accuracy_std": statistics.stdev(acc) if len(acc) > 1 else 0.0,
            "test_accuracy_values": acc,
        }
        if rows[0]["privacy"]:
            t["utility"][dn]["privacy"] = rows[0]["privacy"]
        entry: dict[str, Any] = {
            "claimed_epsilon": _claimed(rows),
            "delta": rows[0]["delta"],
            "confidence": o["confidence"],
            "seeds": len(rows),
        }
        for kind in ("white_box", "black_box"):
            if kind in rows[0]:
                best = max((r[kind] for r in rows), key=lambda a: a["eps_hat"])
                entry[kind] = {**best, "ceiling": max_epsilon(best["m"], best["delta"], confidence)}
        entry["eps_hat"] = max(r["eps_hat"] for r in rows)
        entry["flagged"] = flagged(entry["eps_hat"], entry["claimed_epsilon"])
        t["dp_audit"][dn] = entry
        t["worst_case"][dn] = worst_case({}, {}, None)  # no reconstruction attack runs in this protocol
        t["membership"][dn] = {
            a: _mean_attack([r["membership"][a] for r in rows])
            for a in rows[0]["membership"]
            if a in rows[-1]["membership"]
        }
    return t


def _mean_attack(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean over seeds of an attack's numbers; the first seed's curve."""
    keys = [k for k, v in rows[0].items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    out: dict[str, Any] = {k: statistics.fmean(float(r[k]) for r in rows) for k in keys}
    out["curve"] = rows[0]["curve"]
    return out


@PROTOCOLS.register("dp-audit", "one-run canary audit of a privacy claim (epsilon-hat) and membership inference")
class DPAuditProtocol:
    """What the audit engine calls for a `protocol: dp-audit` task (`veil.experiments.audit`)."""

    validate_task = staticmethod(validate_task)
    run_task = staticmethod(run_task)
