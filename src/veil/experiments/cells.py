"""One audit cell: attack the client updates of a trained run and score what comes back, with
the same harness as `veil attack` (`veil.attacks.harness`): the attack sees only the server's
view and the granted knowledge; the private batch is used afterwards, to score.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

from torch import Tensor

from veil.attacks import Attack, create_attack
from veil.attacks.harness import attack_once, mean_metrics, private_batches, score, sequences, update_seed
from veil.data import DataSplits
from veil.defenses.base import Defense
from veil.experiments.scenario import label
from veil.metrics import text_report
from veil.models.base import VeilModel
from veil.training.step import client_step

#: numbers an attack reports about its own result (`Reconstruction.stats`) that the cell keeps, as
#: ``match_KEY``: a matching attack's best cosine, its margin to the runner-up, its pool size (head-embedding)
MATCH_STATS = ("cosine", "margin", "pool")


def example_of(ref: dict[str, Tensor], rec: Any, tokenizer: Any) -> dict[str, Any]:
    """What the report shows of one attacked update: images side by side, or aligned tokens."""
    if rec.images is not None:
        return {"original": ref["pixels"][:4].tolist(), "reconstruction": rec.images.detach().clamp(0, 1)[:4].tolist()}
    if rec.token_ids is not None:
        words = (
            (lambda ids: list(tokenizer.decode(ids))) if tokenizer is not None else (lambda ids: [str(i) for i in ids])
        )
        refs = sequences(ref)
        order = text_report(refs, rec.token_ids)["order"] if rec.token_ids else [-1] * len(refs)
        return {
            "references": [words(r) for r in refs[:4]],
            "reconstructions": [words(rec.token_ids[j]) if j >= 0 else [] for j in order[:4]],
        }
    return {}


def run_cell(
    attack: Attack,
    model: VeilModel,
    data: DataSplits,
    defenses: list[Defense],
    knowledge: dict[str, Any],
    samples: int,
    seed: int,
    reference: str = "original",
) -> dict[str, Any]:
    """Attack `samples` client steps of one trained run; mean of every metric, first example kept.
    `reference`: score against the private input, or against it as MJP shuffled it ("shuffled")."""
    batch_size = int(knowledge.get("batch_size", 1)) if not isinstance(knowledge.get("batch_size"), bool) else 1
    grant = {k: bool(v) for k, v in knowledge.items()}
    model.train()  # the client trains: defenses such as MJP act in training mode, dropout as configured
    rows, example = [], None
    # every sample starts from the defenses' streams as the cell found them (MJP's pooled masks, noise
    # counts), and the cell leaves them so: a cell's numbers do not depend on which cells ran before it
    # (the order, a resumed audit's cached cells, parallel workers)
    start = [d.state_dict() for d in defenses]
    for k, batch in enumerate(private_batches(data.test, batch_size, samples, seed)):
        for d, state in zip(defenses, start):
            d.load_state_dict(state)
        rec, ref, _ = attack_once(attack, model, batch, defenses, data, reference, update_seed(seed, k), grant)
        row = score(rec, ref, data)
        row.update({f"match_{k}": float(v) for k in MATCH_STATS if isinstance(v := rec.stats.get(k), (int, float))})
        rows.append(row)
        example = example or example_of(ref, rec, data.meta.get("tokenizer"))
    for d, state in zip(defenses, start):
        d.load_state_dict(state)
    out = mean_metrics(rows)
    out.update(samples=samples, batch_size=batch_size)
    return {"metrics": out, "example": example}


def step_overhead(
    models: dict[str, tuple[VeilModel, list[Defense]]],
    batch: dict[str, Tensor],
    repeats: int = 15,
    rounds: dict[str, list[float]] | None = None,
) -> dict[str, float]:
    """Median seconds of one client step (forward, backward, defense, export) per defense,
    interleaved in one run so the machine's noise hits all alike (ratios are what count); the
    order alternates each round so no defense always runs right after another. `rounds`, if
    given, receives every round's seconds per defense (for the spread of the ratios)."""
    times: dict[str, list[float]] = {} if rounds is None else rounds
    times.update({k: [] for k in models})
    for r in range(repeats + 1):
        for k, (m, ds) in list(models.items()) if r % 2 else list(models.items())[::-1]:
            m.train()
            t0 = time.perf_counter()
            client_step(m, batch, ds, None, step=r, clip=1.0, export=True)  # no optimiser: weights stay
            if r:  # the first round warms up
                times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def make_attack(entry: dict[str, Any]) -> Attack:
    return create_attack(entry["name"], **{k: v for k, v in entry.items() if k != "name"})


def cell_path(out: Path, cell: Any) -> Path:
    """Where the audit keeps one cell's result: cells/TASK/DEFENSE/ATTACK/seedN.json."""
    return out / "cells" / cell.task.name / label(cell.defense) / label(cell.attack) / f"seed{cell.seed}.json"


def examples(out: Path, task: str) -> list[dict[str, Any]]:
    """What the report shows of a task's cells (single-step, or written by a protocol in the same
    layout): per (defense, attack), the first seed's example, as records
    {defense, attack, example} in file order."""
    found: dict[tuple[str, str], dict[str, Any]] = {}
    for f in sorted((out / "cells" / task).glob("*/*/seed*.json")):
        key = (f.parent.parent.name, f.parent.name)
        if key not in found:
            found[key] = json.loads(f.read_text()).get("example") or {}
    return [{"defense": d, "attack": a, "example": ex} for (d, a), ex in found.items()]
