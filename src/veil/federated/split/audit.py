"""`protocol: split` in `veil audit` scenarios: split learning (SL), FeSTA and p-FeSTA (Park et al.,
p-FeSTA, Tables IV-V; the engine is `veil.federated.split`) trained over Flower messages, each
protocol's task metrics and measured bytes beside the paper's formulas, and the feature-space
attacks a curious server runs on the smashed data it receives (`veil.attacks.features`).

    - name: digits-split
      protocol: split
      run: {model: vit-digits, data: digits, train: {batch_size: 16, lr: 0.001}}
      defenses: [sl, festa, pfesta, {name: pfesta, defense: none}]   # the split protocols (+ split overrides)
      attacks: [{name: feature_inversion, unshuffle: false}, feature_inversion, fsha]
      federated: {tasks: [classify, zones, segment], clients_per_task: 2, epochs: 10, victims: 64}

`defenses` name the protocols (sl | festa | pfesta | fl | central), each a mapping of `split`
keys beside its name, and `defense`: the feature defense its clients apply (pfesta: the
permutation module unless `defense: none`, the ablation in patch order; the others: none); `federated` holds the shared `split` section (every key but `protocol`)
and `victims`, the private images attacked (default 64).

Threat model of the feature attacks (the server): it receives a client's head features (patch
embeddings) — under SL / FeSTA in patch order, under p-FeSTA permuted per sample with a
client-only key when the permutation defense is on; it holds auxiliary public images (the digits test split,
disjoint from every client's training data) and query access to the head at its initialisation
(p-FeSTA's frozen, shared head; under SL / FeSTA the features of the first step come from that
head); it knows its own protocol (`Knowledge.defense` names the permutation when it is on), so
`feature_inversion` un-shuffles through the head before decoding unless `unshuffle: false`
(the naive decoder the paper's claim rests on). FL and central send no features: not attacked.
Scores: PSNR / SSIM / MSE of the rebuilt batch against the private one (Hungarian-matched).

Resume: each protocol run is a folder reused when its resolved config matches
(`veil.federated.split.compare.cached_run`); each feature-attack cell is a JSON file under cells/.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import torch

from veil import registry
from veil.attacks import attacks_observing
from veil.attacks.features import SPLIT_ROWS, row_entry
from veil.errors import VeilError
from veil.experiments.audit import run_dir
from veil.experiments.cells import make_attack
from veil.experiments.scenario import Scenario, Task, label
from veil.experiments.summary import budget_rollup, task_entry
from veil.federated.split.compare import cached_run
from veil.federated.split.feature_audit import attack_features, victim_view
from veil.federated.split.spec import permutes, split_spec_from_raw
from veil.io import atomic_write_text
from veil.metrics.leakage import worst_case

PROTOCOLS = ("sl", "festa", "pfesta", "fl", "central")
SENDS_FEATURES = ("sl", "festa", "pfesta")


def task_spec(task: Task, protocol: dict[str, Any], seed: int) -> Any:
    """The split run of one protocol and seed: the task's run + its `federated` (split) section + the protocol entry."""
    if protocol["name"] not in PROTOCOLS:
        raise VeilError(
            f"task '{task.name}': unknown split protocol '{protocol['name']}' in defenses; allowed: {', '.join(PROTOCOLS)}"
        )
    shared = {k: v for k, v in task.federated.items() if k != "victims"}
    if "protocol" in shared:
        raise VeilError(
            f"task '{task.name}': federated.protocol is set by each defenses entry (sl, festa, pfesta, ...); remove it"
        )
    raw = task.run_for({"name": "none"}, seed).to_dict()
    # p-FeSTA is defined with its permutation module (Alg. 1); `defense: none` is the ablation
    raw["defense"] = protocol.get("defense", "permutation" if protocol["name"] == "pfesta" else [])
    split = {
        **shared,
        **{k: v for k, v in protocol.items() if k not in ("name", "defense")},
        "protocol": protocol["name"],
    }
    try:
        return split_spec_from_raw({**raw, "split": split})
    except VeilError as e:
        raise VeilError(f"task '{task.name}': {e}") from None


def attacks_of(task: Task, s: Scenario) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """(feature attacks to run, {attack: why skipped}); a task's own attack that is not a feature attack is an error."""
    own = {label(a) for a in task.attacks}
    run, skipped = [], {}
    for a in task.attacks + [a for a in s.attacks if label(a) not in own]:
        if "features" in make_attack(a).observes:
            run.append(a)
        elif label(a) in own:
            raise VeilError(
                f"attack '{a['name']}' does not apply to task '{task.name}': a split-learning server sees head features, "
                f"not gradients; use {' or '.join(attacks_observing('features'))}"
            )
        else:
            skipped[label(a)] = "a split-learning server sees head features, not parameter updates"
    return run, skipped


def validate_task(task: Task, s: Scenario) -> None:
    victims = task.federated.get("victims", 64)
    if not isinstance(victims, int) or victims < 1:
        raise VeilError(f"task '{task.name}': federated.victims must be a positive integer, got {victims!r}")
    attacks_of(task, s)
    for d in task.defenses:
        for seed in s.seeds:
            task_spec(task, d, seed)


def attack_cell(spec: Any, attack: dict[str, Any], permuted: bool, victims: int) -> dict[str, float]:
    """One feature attack on the first client's private images as the server receives them."""
    torch.manual_seed(spec.cfg.train.seed)
    private, aux, head, feats, module = victim_view(spec, victims)
    if permuted:
        feats = module.before_send(feats, {})
    known = {module.name: module.describe()} if permuted else {}
    return attack_features(make_attack(attack), feats, private, aux, head, known, spec.cfg.train.seed)


def run_task(task: Task, s: Scenario, out: Path, progress: bool = False) -> dict[str, Any]:
    """Every protocol (defense) and seed: metrics, bytes, and the feature attacks; the task's summary entry."""
    attacks, skipped = attacks_of(task, s)
    victims = int(task.federated.get("victims", 64))
    knows = {label(a): make_attack(a).knows for a in attacks}
    t = task_entry(task, victims, dropout=0.0, skipped=skipped, attacker_knows=knows, tables=("budget", "split"))
    for d in task.defenses:
        dn, runs, cells = label(d), [], []
        for seed in s.seeds:
            spec = task_spec(task, d, seed)
            runs.append(cached_run(spec, run_dir(out, task, d, seed)))
            if d["name"] not in SENDS_FEATURES:
                continue
            permuted = permutes(spec)
            row = {}
            for a in attacks:
                path = out / "cells" / task.name / dn / label(a) / f"seed{seed}.json"
                if not path.is_file():
                    path.parent.mkdir(parents=True, exist_ok=True)
                    atomic_write_text(
                        path, json.dumps({"metrics": attack_cell(spec, a, permuted, victims), "permuted": permuted})
                    )
                row[label(a)] = json.loads(path.read_text())["metrics"]
            cells.append(row)
        t["split"][dn] = split_entry(runs)
        t["utility"][dn] = utility(runs)
        if cells:
            t["leakage"][dn] = {a: {k: statistics.fmean(c[a][k] for c in cells) for k in cells[0][a]} for a in cells[0]}
            spent = {a: budget_rollup([c[a] for c in cells]) for a in cells[0]}
            t["budget"][dn] = {a: acc for a, acc in spent.items() if acc}
            t["worst_case"][dn] = worst_case(t["leakage"][dn], knows)
        else:  # nothing to attack: the verdict says no attack measured leakage
            t["worst_case"][dn] = worst_case({}, knows)
    return t


def utility(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The first task's metric (accuracy for classify) as test_accuracy, every task's metric beside it."""
    first = runs[0]["tasks"][0]
    vals = [float(r["metrics"][first]) for r in runs]
    return {
        "test_accuracy_mean": statistics.fmean(vals),
        "test_accuracy_std": statistics.stdev(vals) if len(vals) > 1 else 0.0,
        "test_accuracy_values": vals,
        "metric": runs[0]["metric_names"][first],
        "train_seconds_mean": statistics.fmean(float(r["seconds"]) for r in runs),
    }


def split_entry(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-task metrics (mean over seeds), bytes per client measured and by the paper's formula."""
    r0 = runs[0]
    out: dict[str, Any] = {
        "metrics": {k: statistics.fmean(float(r["metrics"][k]) for r in runs) for k in r0["metrics"]},
        "metric_names": r0["metric_names"],
        "protocol": r0["protocol"],
        "permute": r0.get("permute"),
    }
    if "bytes_per_client" in r0:
        out["bytes_per_client"] = statistics.fmean(float(r["bytes_per_client"]) for r in runs)
        paper = r0["paper_bytes_per_client"]
        out["paper_bytes_per_client"] = paper.get(r0["protocol"])
    return out


#: the rows of p-FeSTA's Tables IV-V, and the feature attacks of `veil.federated.split.feature_audit`
TABLE_PROTOCOLS = ["central", "fl", "sl", "festa", "pfesta"]
TABLE_ATTACKS: list[Any] = [row_entry(row, settings) for row, settings in SPLIT_ROWS.items()]


def scenario_from_run_config(raw: dict[str, Any], name: str) -> dict[str, Any]:
    """A `veil split` run config (model / data / train / split) as an audit scenario: one split task
    over every protocol of Tables IV-V, attacked with the feature attacks (so `veil audit` takes it)."""
    base = {k: v for k, v in raw.items() if k in ("model", "data", "train", "defense")}
    split = {k: v for k, v in (raw.get("split") or {}).items() if k != "protocol"}
    seed = int((raw.get("train") or {}).get("seed", 0))
    return {
        "name": name,
        "seeds": [seed],
        "tasks": [
            {
                "name": f"{name}-split",
                "protocol": "split",
                "run": base,
                "defenses": list(TABLE_PROTOCOLS),
                "attacks": list(TABLE_ATTACKS),
                "federated": split,
            }
        ],
    }


@registry.PROTOCOLS.register("split", "SL / FeSTA / p-FeSTA split learning, audited in feature space")
class SplitProtocol:
    """What the audit engine calls for a `protocol: split` task (`veil.experiments.audit`), and
    how a `veil split` run config becomes a scenario (`veil.experiments.scenario`)."""

    validate_task = staticmethod(validate_task)
    run_task = staticmethod(run_task)
    scenario_from_run_config = staticmethod(scenario_from_run_config)
