"""The audit engine behind `veil audit`: train one model per defense, attack each, and sum
privacy against utility up in summary.json (the report renders it: `veil.report`).

Every finished piece is a file — a run folder per (task, defense, seed), a JSON per attack cell
— written atomically, so a killed audit resumes without recomputing anything it finished. A task
of another protocol (fedavg, split) is trained and attacked by the protocol registered under its
name in `veil.registry.PROTOCOLS`; the engine imports none of them.
"""

from __future__ import annotations

import contextlib
import importlib.metadata as md
import json
import math
import multiprocessing as mp
import os
import platform
import statistics
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from veil.attacks.base import attack_progress
from veil.attacks.harness import attack_device, private_batches
from veil.build import build_data, build_defenses, build_model, build_run, load_run
from veil.errors import VeilError
from veil.experiments.cells import cell_path, make_attack, run_cell, step_overhead
from veil.experiments.census import attach_census, census_all
from veil.experiments.evaluations import run_evaluations
from veil.experiments.features import frozen_run
from veil.experiments.scenario import Scenario, Task, dump_scenario, label
from veil.experiments.summary import build_summary, over_budget
from veil.io import atomic_write_text, intact, write_checked_text
from veil.registry import PROTOCOLS
from veil.runlock import holds_progress
from veil.runtime import free_cores, use_threads
from veil.training.loop import train


@dataclass
class Cell:
    task: Task
    defense: dict[str, Any]
    attack: dict[str, Any]
    seed: int
    skipped: str | None = None  # why the attack does not apply

    @property
    def key(self) -> tuple[str, str, str, int]:
        return (self.task.name, label(self.defense), label(self.attack), self.seed)


def validate(s: Scenario) -> list[Cell]:
    """Check every name, key, path and attack before any training; return the cells to run."""
    cells: list[Cell] = []
    loaded: dict[str, Any] = {}  # tasks that share a data set load it once (a full SST-2 takes seconds)
    for task in s.tasks:
        if task.protocol != "single-step":  # trained and attacked by its protocol's module, not by cells
            protocol_module(task).validate_task(task, s)
            continue
        key = json.dumps(task.run.data, sort_keys=True, default=str)
        if key not in loaded:
            loaded[key] = build_data(task.run)
        data = loaded[key]
        model = build_model(task.run, data)
        for d in task.defenses:
            cfg = task.run_for(d, s.seeds[0])  # validates the defense name and its keys
            for defense in build_defenses(cfg):
                defense.attach(model)
                defense.detach()
                if task.weights == "trained":
                    _check_schedule(defense, cfg, len(data.train["labels"]), f"task '{task.name}', defense {label(d)}")
        own = [(a, True) for a in task.attacks]
        shared = [(a, False) for a in s.attacks if label(a) not in {label(x) for x in task.attacks}]
        granted = task.knowledge.get("batch_size", 1)
        batch = 1 if isinstance(granted, bool) else int(granted)  # the batch run_cell draws
        listed = {label(a) for a, _ in own + shared}
        for a, required in own + shared:
            reason = make_attack(a).applies(model, batch, "single-step")  # batch, family, dropout, protocol
            alt = instead(a, model, batch) if reason else None
            if reason and required and alt is None:
                raise VeilError(f"attack '{a['name']}' does not apply to task '{task.name}': {reason}")
            routed = [alt] if alt is not None and label(alt) not in listed else []
            if alt is not None:
                reason = f"{reason} (the audit runs {label(alt)} here)"
            listed |= {label(x) for x in routed}
            for entry, why in [(a, reason)] + [(x, None) for x in routed]:
                for d in task.defenses:
                    for seed in s.seeds:
                        cells.append(Cell(task, d, entry, seed, why))
    return cells


def instead(entry: dict[str, Any], model: Any, batch: int) -> dict[str, Any] | None:
    """The attacker that applies where `entry`'s does not because the client trains with dropout
    (its declared ``dropout_breaks`` alternative, e.g. span -> span-robust), at its own default
    options (a name two attacks share need not mean the same: span's tol1 is not span-robust's);
    None when there is none or it does not apply either."""
    from veil.attacks.base import client_dropout

    breaks = make_attack(entry).dropout_breaks
    if breaks is None or client_dropout(model) <= 0:
        return None
    alt = {"name": breaks[1]}
    return alt if make_attack(alt).applies(model, batch, "single-step") is None else None


def _check_schedule(defense: Any, cfg: Any, n_train: int, where: str) -> None:
    """A DP defense learns the run's schedule before its first step (`prepare`): a batch larger
    than the training set, or an epsilon the accountant cannot reach, fails here, before any training."""
    if not getattr(defense, "poisson", False):
        return
    steps = cfg.train.max_steps or cfg.train.epochs * math.ceil(n_train / cfg.train.batch_size)
    try:
        defense.prepare(n_train, cfg.train.batch_size, steps)
    except VeilError as e:
        raise VeilError(f"{where}: {e}") from None


def protocol_module(task: Task) -> Any:
    """The protocol that audits a non-single-step task: `validate_task(task, s)`, `run_task(task, s, out, progress)`."""
    return PROTOCOLS.create(task.protocol)


def run_dir(out: Path, task: Task, defense: dict[str, Any], seed: int) -> Path:
    return out / "runs" / task.name / label(defense) / f"seed{seed}"


def run_audit(s: Scenario, out: str | Path, progress: bool = True, jobs: int = 1) -> dict[str, Any]:
    """Run (or resume) scenario `s` into `out`; returns the summary, also written to summary.json.
    ``jobs``: worker processes for the training runs and the attack cells (0: the free cores);
    the numbers do not depend on it."""
    out = Path(out)
    cells = validate(s)
    marker = out / "scenario.yaml"
    if (
        marker.is_file() and marker.read_text() != dump_scenario(s) and holds_progress(out)
    ):  # else: nothing ran yet, take over
        raise VeilError(f"audit folder '{out}' holds a different scenario; pick a new --out or remove it")
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(marker, dump_scenario(s))
    single = replace(s, tasks=[t for t in s.tasks if t.protocol == "single-step"])
    jobs = jobs or free_cores()
    with _pool(jobs) if jobs > 1 else contextlib.nullcontext() as pool:  # one set of workers for both phases
        utility = _train_all(single, out, progress, pool)
        _attack_all(cells, out, progress, pool, s.device)
    overhead = {t.name: _overhead(t, out, s.seeds[0]) for t in single.tasks if t.weights == "trained"}
    summary = build_summary(single, out, cells, utility, overhead, versions())
    census_all(single, out, run_dir)  # what the server sees, tensor by tensor (veil.experiments.census)
    attach_census(summary, single, out)
    done = summary["tasks"]
    protocol = {
        t.name: protocol_module(t).run_task(t, s, out, progress) for t in s.tasks if t.protocol != "single-step"
    }
    summary["tasks"] = {t.name: done.get(t.name) or protocol[t.name] for t in s.tasks}  # scenario order
    summary["over_budget"] = over_budget(summary)  # every engine's cells, the protocols' included
    atomic_write_text(out / "summary.json", json.dumps(summary, indent=2))
    return summary


def _train_one(cfg: Any, path: Path, progress: bool, features: Path | None = None) -> dict[str, Any]:
    """One run through `veil.training.loop.train`; a `train.frozen_features` run gets the frozen
    encoder's features of both splits from the audit's cache (`veil.experiments.features`)."""
    if features is not None and cfg.train.frozen_features and not (path / "summary.json").is_file():
        model, data, defenses = frozen_run(cfg, features, progress)
        return train(cfg, path, model=model, data=data, defenses=defenses, progress=progress)
    return train(cfg, path, progress=progress)


def _one_thread_each(parent: int) -> None:
    """A worker of a parallel audit: one torch thread (``threads: 0`` resolves through the env),
    and it ends when the audit process `parent` is gone."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True, name="veil-parent-watch").start()


def _exit_with_parent(parent: int, every: float = 0.5) -> None:
    """End this worker once its audit is gone: an audit killed by a signal its workers do not get
    (``kill PID``, SIGKILL, the OOM killer) would otherwise leave them training on, unseen, into
    run folders whose owner no longer holds the lock, beside the rerun that the user starts."""
    while os.getppid() == parent:
        time.sleep(every)
    os._exit(1)


def _pool(jobs: int) -> ProcessPoolExecutor:
    return ProcessPoolExecutor(
        jobs, mp_context=mp.get_context("spawn"), initializer=_one_thread_each, initargs=(os.getpid(),)
    )


def _train_all(
    s: Scenario, out: Path, progress: bool, pool: ProcessPoolExecutor | None = None
) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """Every (task, defense, seed) run; with a `pool`, in its worker processes (one torch thread
    each). Each run owns its folder, so parallel runs never share a file."""
    # seed-major: the first finished runs already cover every defense of every task
    todo = [(t, d, seed) for seed in s.seeds for t in s.tasks for d in t.defenses if t.weights == "trained"]
    args = [(t.run_for(d, seed), run_dir(out, t, d, seed)) for t, d, seed in todo]
    features = out / "features"
    if pool is not None and len(args) > 1:
        for cfg, path in args:  # the shared features first, here: workers only read them (no two write one file)
            if cfg.train.frozen_features and not (path / "summary.json").is_file():
                frozen_run(cfg, features, progress)
        futures = [pool.submit(_train_one, cfg, path, False, features) for cfg, path in args]
        summaries = [f.result() for f in tqdm(futures, desc="train", disable=not progress, unit="run")]
    else:
        summaries = [
            _train_one(cfg, path, progress, features)
            for cfg, path in tqdm(args, desc="train", disable=not progress, unit="run")
        ]
    utility: dict[str, dict[str, list[dict[str, Any]]]] = {
        t.name: {label(d): [] for d in t.defenses} for t in s.tasks if t.weights == "init"
    }  # attacked at init: nothing trained, no utility
    for (t, d, seed), summary in zip(todo, summaries):
        if t.evaluate:  # the task's evaluations beyond test accuracy, cached in the run folder
            summary = {**summary, "evaluations": run_evaluations(run_dir(out, t, d, seed), t.evaluate, seed)}
        utility.setdefault(t.name, {}).setdefault(label(d), []).append(summary)
    return utility


def _attack_all(
    cells: list[Cell], out: Path, progress: bool, pool: ProcessPoolExecutor | None = None, device: str = "auto"
) -> None:
    """Every cell not cached yet, grouped by the run it attacks (each run is loaded once), on
    `device` (`scenario.attack.device`); with a `pool`, the groups go to its worker processes.
    Cells are independent of one another
    (`run_cell` restores the defenses' streams), so the numbers are the sequential audit's."""
    todo = [c for c in cells if c.skipped is None and not _reusable(cell_path(out, c))]
    groups: dict[tuple[str, str, int], list[Cell]] = {}
    for c in todo:
        groups.setdefault((c.task.name, label(c.defense), c.seed), []).append(c)
    bar = tqdm(total=len(todo), desc="attack", disable=not progress, unit="cell")
    if pool is not None and len(groups) > 1:
        for f in as_completed([pool.submit(_attack_group, g, out, device) for g in groups.values()]):
            bar.update(f.result())
    else:
        with attack_progress(progress):  # an attack's bar over its work inside the cell (workers: none)
            for g in groups.values():
                bar.update(_attack_group(g, out, device))
    bar.close()


def _attack_group(cells: list[Cell], out: Path, device: str = "auto") -> int:
    """Attack one run's cells on `device` (`veil.attacks.harness.attack_device`), each written to
    its own file; returns how many."""
    c0 = cells[0]
    if c0.task.weights == "init":  # the seeded initial weights, as `veil attack` builds them
        model, data, defenses = build_run(c0.task.run_for(c0.defense, c0.seed))
    else:
        _, model, data, defenses = load_run(run_dir(out, c0.task, c0.defense, c0.seed))
    use_threads(c0.task.run.train.threads)
    model.to(attack_device(device))
    for c in cells:
        try:
            t = c.task
            result = run_cell(make_attack(c.attack), model, data, defenses, t.knowledge, t.samples, c.seed, t.reference)
        except VeilError as e:  # the defense took away what the attack needs: that channel is closed
            result = {"metrics": {}, "blocked": str(e), "example": None}
        path = cell_path(out, c)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_checked_text(path, json.dumps(result))
    return len(cells)


def _reusable(path: Path) -> bool:
    """A cached cell is reused only when its bytes match the hash recorded with it; a damaged one
    is recomputed (a cell is cheap next to a training run), with one line saying so."""
    if not path.is_file():
        return False
    if intact(path):
        return True
    print(f"veil: cached result '{path}' fails its integrity check; recomputing it", file=sys.stderr)
    return False


def _quartiles(times: list[float], reference: list[float]) -> list[float]:
    """The lower and upper quartile of the round-by-round ratios times / reference."""
    q = statistics.quantiles([t / r for t, r in zip(times, reference)], n=4)
    return [q[0], q[2]]


def _overhead(task: Task, out: Path, seed: int) -> dict[str, float]:
    """Step time per defense relative to none, measured once per task and cached; none is
    measured beside the defenses even where the task does not train it (its step needs no run)."""
    path = out / "cells" / task.name / "overhead.json"
    if _reusable(path):
        return json.loads(path.read_text())
    models = {}
    data = None
    trained = {label(d) for d in task.defenses}
    for d in task.defenses if "none" in trained else [{"name": "none"}, *task.defenses]:
        cfg = task.run_for(d, seed)
        model, data, defenses = build_run(cfg, data)
        for defense in defenses:  # DP-SGD's noise for the run's schedule (target_epsilon: from the accountant)
            _check_schedule(defense, cfg, len(data.train["labels"]), f"task '{task.name}', defense {label(d)}")
        models[label(d)] = (model, defenses)
    assert data is not None
    batch = private_batches(data.train, min(32, len(data.train["labels"])), 1, seed)[0]
    rounds: dict[str, list[float]] = {}
    seconds = step_overhead(models, batch, rounds=rounds)
    result = {
        "seconds": seconds,
        "ratio": {k: v / seconds["none"] for k, v in seconds.items() if k in trained},
        "ratio_spread": {k: _quartiles(v, rounds["none"]) for k, v in rounds.items() if k in trained},
        "batch_size": len(batch["labels"]),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    write_checked_text(path, json.dumps(result))
    return result


def versions() -> dict[str, str]:
    """The versions of Python, the platform and the packages the numbers depend on."""
    out = {"python": platform.python_version(), "platform": platform.platform()}
    for pkg in ("veil", "torch", "transformers", "flwr", "torchmetrics", "opacus", "numpy"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = "not installed"
    return out
