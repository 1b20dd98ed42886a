"""`protocol: fedavg` in `veil audit` scenarios: the task trains on Flower (veil's ServerApp +
ClientApp, `veil.federated.fedavg.runner.federate`) once per defense and seed, the defenses on the
clients, and the live auditor (`veil.federated.fedavg.auditor`) — the honest-but-curious server — runs
the task's attacks on the updates it really receives, at the rounds and clients the task names.

    - name: digits-fedavg
      protocol: fedavg
      run: {model: vit-digits, data: digits, train: {batch_size: 32, lr: 0.003}}
      defenses: [none, {name: mjp, gamma: 0.1}]
      attacks: [ig, labels]              # the auditor's attacks (federated.audit is set from these)
      federated: {clients: 10, rounds: 10, local_epochs: 2, audit_every: 1, audit_clients: 2}

Every `federated` key of a run config is allowed except `audit`; the audit defaults to the
in-process grid (`backend: inline`: every message is still serialised to Flower's protobuf, so
the byte counts are exact) and to seeded client secrets (`secret: seeded`: a resumed audit
recomputes identical rounds); a scenario may set `backend: ray` (Flower's simulation engine).

What the attacks see. FedAvg: the pseudo-gradient (w_global - w_k) / (lr * s) of s local steps
over several batches (`Observation.kind = "delta"`); FedSGD: one defended gradient. An attack
runs where it observes that view (`Attack.observes`): one that reads a single gradient only is
skipped on FedAvg updates, with the reason, and runs under ``mode: fedsgd``. The server is granted the configured batch size,
input shape, the public tokenizer and the defenses' settings (adaptive attackers); never labels.

Scoring. The auditor's evaluation channel re-derives the round's batches (simulation only) and
scores each reconstruction against every distinct sample the client trained on that round.

Resume. A run folder per (defense, seed) is the federated runner's own (checkpoint after every
round, audit events in metrics.jsonl): a killed audit rerun resumes each run at its last
finished round and skips finished runs, with identical numbers (seeded secrets).

summary["tasks"][task] (beside the single-step keys utility / leakage / worst_case / ...):
  rounds[defense]   per round: round, test_accuracy, train_loss, bytes_down, bytes_up, leakage
                    {attack: metrics, mean over audited clients and seeds}, worst_case
  clients[defense]  per audited client: {attack: its most-leaking round's metrics (with round)}
  bytes[defense]    bytes_total (down + up, every round), bytes_per_round
  leakage[defense][attack]  the attack's most-leaking audited round (key `round`), so the
                    verdict worst_case[defense] is the worst round of the strongest attack
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from veil.build import build_data, build_defenses, build_model
from veil.errors import VeilError
from veil.experiments.audit import run_dir
from veil.experiments.cells import make_attack
from veil.experiments.scenario import Scenario, Task, label
from veil.experiments.summary import budget_rollup, task_entry
from veil.federated.fedavg.config import federated_config
from veil.federated.fedavg.runner import federate
from veil.federated.fedavg.task import spec_from_raw
from veil.metrics.leakage import cell_leakage, worst_case
from veil.registry import PROTOCOLS

DEFAULTS = {"backend": "inline", "secret": "seeded"}
SKIP_KEYS = {"round", "client", "event", "attack", "update", "verified"}


def task_spec(task: Task, defense: dict[str, Any], seed: int, attacks: list[dict[str, Any]]) -> Any:
    """The federated run of one (defense, seed): the task's run + its `federated` section + attacks."""
    raw = task.run_for(defense, seed).to_dict()
    fed = {**DEFAULTS, **task.federated, "audit": attacks}
    try:
        return spec_from_raw({**raw, "federated": fed})
    except VeilError as e:
        raise VeilError(f"task '{task.name}': {e}") from None


def plan(task: Task, s: Scenario) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """(the attacks the auditor runs, {attack: why skipped}); a task's own attack that cannot run is an error."""
    if "audit" in task.federated:
        raise VeilError(f"task '{task.name}': federated.audit is set from the task's attacks; remove it")
    if task.knowledge.get("labels"):
        raise VeilError(
            f"task '{task.name}': knowledge.labels cannot be granted under protocol {task.protocol} (the server sees only updates)"
        )
    fed = federated_config({**DEFAULTS, **task.federated})
    model = build_model(task.run, build_data(task.run))
    own = {label(a) for a in task.attacks}
    run, skipped = [], {}
    other = {"fedavg": "fedsgd", "fedsgd": "fedavg"}[fed.mode]
    for a in task.attacks + [a for a in s.attacks if label(a) not in own]:
        attack = make_attack(a)
        reason = attack.applies(model, protocol=fed.mode)  # family, dropout, the views it observes
        # a task's own attack that the other federated mode would audit is skipped with the reason
        # (e.g. a one-gradient attack beside a FedAvg task's other attacks); any other is an error
        if reason and label(a) in own and attack.applies(model, protocol=other) is not None:
            raise VeilError(f"attack '{a['name']}' does not apply to task '{task.name}': {reason}")
        if reason:
            skipped[label(a)] = reason
        else:
            run.append(a)
    names = [a["name"] for a in run]
    if len(set(names)) != len(names):  # the live auditor logs events by attack name
        raise VeilError(
            f"task '{task.name}': under protocol {task.protocol} each attack name may appear once, got {names}"
        )
    return run, skipped


def validate_task(task: Task, s: Scenario) -> None:
    """Every name and key checked before any training (the defenses through the run config)."""
    attacks, _ = plan(task, s)
    for d in task.defenses:
        for seed in s.seeds:
            build_defenses(task_spec(task, d, seed, attacks).cfg)


def read_events(run_dir: Path, labels: dict[str, str]) -> list[dict[str, Any]]:
    """The run's metrics.jsonl, each audit event's attack named by its scenario label (ig(iterations=200))."""
    path = run_dir / "metrics.jsonl"
    events = [json.loads(ln) for ln in path.read_text().splitlines() if ln] if path.is_file() else []
    return [{**e, "attack": labels.get(e["attack"], e["attack"])} if e.get("event") == "audit" else e for e in events]


def _numeric(e: dict[str, Any]) -> dict[str, float]:
    return {
        k: float(v)
        for k, v in e.items()
        if k not in SKIP_KEYS and isinstance(v, (int, float)) and not isinstance(v, bool)
    }


def _mean(rows: list[dict[str, float]]) -> dict[str, float]:
    keys = sorted(set().union(*rows)) if rows else []
    return {k: statistics.fmean(r[k] for r in rows if k in r) for k in keys}


def per_round(events: list[list[dict[str, Any]]], knows: dict[str, str]) -> list[dict[str, Any]]:
    """One row per round: accuracy and bytes (mean over seeds), each attack's mean leakage, the worst case."""
    rounds: dict[int, list[dict[str, Any]]] = defaultdict(list)
    audits: dict[int, dict[str, list[dict[str, float]]]] = defaultdict(lambda: defaultdict(list))
    errors: dict[int, dict[str, str]] = defaultdict(dict)
    for run in events:
        for e in run:
            if e.get("event") == "round":
                rounds[e["round"]].append(e)
            elif e.get("event") == "audit" and "error" in e:
                errors[e["round"]][e["attack"]] = e["error"]
            elif e.get("event") == "audit" and "skipped" not in e:
                audits[e["round"]][e["attack"]].append(_numeric(e))
    out = []
    for r in sorted(rounds):
        evs = rounds[r]
        row: dict[str, Any] = {
            "round": r,
            **{k: statistics.fmean(float(e[k]) for e in evs) for k in ("test_accuracy", "bytes_down", "bytes_up")},
            "train_loss": statistics.fmean(float(e["train_loss"]) for e in evs)
            if all(e.get("train_loss") is not None for e in evs)
            else None,
        }
        leak = {a: _mean(rows) for a, rows in audits.get(r, {}).items()}
        row["leakage"] = leak
        row["worst_case"] = worst_case(leak, knows, errors.get(r)) if leak or errors.get(r) else None
        out.append(row)
    return out


def most_leaking(rows: list[tuple[int, dict[str, float]]]) -> dict[str, float]:
    """The (round, metrics) whose leakage scores highest (`veil.metrics.leakage.cell_leakage`), with its round."""

    def key(rm: tuple[int, dict[str, float]]) -> tuple[int, float, int]:
        c = cell_leakage(rm[1])
        return (c["tier"], c["score"], -rm[0]) if c else (-1, 0.0, -rm[0])

    r, m = max(rows, key=key)
    return {"round": float(r), **m}


def per_client(events: list[list[dict[str, Any]]]) -> dict[str, dict[str, dict[str, float]]]:
    """{client: {attack: metrics of its most-leaking audited round}} (seeds pooled)."""
    rows: dict[str, dict[str, list[tuple[int, dict[str, float]]]]] = defaultdict(lambda: defaultdict(list))
    for run in events:
        for e in run:
            if e.get("event") == "audit" and "skipped" not in e and "error" not in e:
                rows[str(e["client"])][e["attack"]].append((e["round"], _numeric(e)))
    return {c: {a: most_leaking(v) for a, v in by.items()} for c, by in sorted(rows.items())}


def budget(events: list[list[dict[str, Any]]]) -> dict[str, dict[str, float]]:
    """{attack: its budget account} over every audited update of every round and seed (not only
    the most-leaking one: a cell is over budget when any attack run was)."""
    rows: dict[str, list[dict[str, float]]] = defaultdict(list)
    for run in events:
        for e in run:
            if e.get("event") == "audit" and "budget_used" in e:
                rows[e["attack"]].append(_numeric(e))
    return {a: acc for a, r in rows.items() if (acc := budget_rollup(r))}


def run_task(task: Task, s: Scenario, out: Path, progress: bool = False) -> dict[str, Any]:
    """Train and audit every (defense, seed) on Flower; the task's summary entry (see the module doc)."""
    attacks, skipped = plan(task, s)
    knows = {label(a): make_attack(a).knows for a in attacks}
    t = task_entry(task, 0, skipped=skipped, attacker_knows=knows, tables=("budget", "rounds", "clients", "bytes"))
    for d in task.defenses:
        runs, events = [], []
        for seed in s.seeds:
            spec = task_spec(task, d, seed, attacks)
            folder = run_dir(out, task, d, seed)
            runs.append(federate(spec, folder, resume=True, progress=progress))
            events.append(read_events(folder, {a["name"]: label(a) for a in attacks}))
        t["federated"] = {k: v for k, v in spec.fed.to_dict().items() if k not in ("audit", "fail")}
        dn = label(d)
        t["utility"][dn] = utility(runs)
        t["rounds"][dn] = per_round(events, knows)
        t["clients"][dn] = per_client(events)
        t["bytes"][dn] = {
            "bytes_total": statistics.fmean(r["bytes_total"] for r in runs),
            "bytes_per_round": statistics.fmean(r["bytes_total"] / max(1, r["rounds"]) for r in runs),
        }
        by_attack: dict[str, list[tuple[int, dict[str, float]]]] = defaultdict(list)
        for row in t["rounds"][dn]:
            for a, m in row["leakage"].items():
                by_attack[a].append((row["round"], m))
        t["leakage"][dn] = {a: most_leaking(v) for a, v in by_attack.items()}
        t["budget"][dn] = budget(events)
        errors = {  # why an attack gave no number: its error, or why it was skipped (e.g. the client's dropout)
            e["attack"]: e.get("error", e.get("skipped"))
            for run in events
            for e in run
            if e.get("event") == "audit" and ("error" in e or "skipped" in e)
        }
        failed = {
            a: errors.get(a, "no audited update") for a in knows if a not in by_attack
        }  # e.g. AEGIS froze the layer it reads
        if failed:
            t["blocked"][dn] = failed
        t["worst_case"][dn] = worst_case(t["leakage"][dn], knows, failed)
    t["samples"] = int(t["federated"]["audit_clients"])
    # the threat model of the task's findings: what the server saw (one client's update, an aggregate, ...)
    t["server_saw"] = sorted(
        {str(e["server_saw"]) for run in events for e in run if e.get("event") == "audit" and "server_saw" in e}
    )
    # where the report draws its per-round figure (`veil.report.protocols`): the engine records data only
    t["figure"] = str(Path("figures") / f"{_slug(task.name)}_rounds.png") if any(t["rounds"].values()) else None
    return t


def utility(runs: list[dict[str, Any]]) -> dict[str, Any]:
    acc = [float(r["test_accuracy"]) for r in runs]
    u: dict[str, Any] = {
        "test_accuracy_mean": statistics.fmean(acc),
        "test_accuracy_std": statistics.stdev(acc) if len(acc) > 1 else 0.0,
        "test_accuracy_values": acc,
        "train_seconds_mean": statistics.fmean(float(r["train_seconds"]) for r in runs),
    }
    if runs[0].get("dp"):
        u["federated_dp"] = runs[0]["dp"]
    return u


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-." else "_" for c in text).strip("_")


@PROTOCOLS.register("fedavg", "FedAvg / FedProx on Flower, audited round by round by the curious server")
class FedAvgProtocol:
    """What the audit engine calls for a `protocol: fedavg` task (`veil.experiments.audit`)."""

    validate_task = staticmethod(validate_task)
    run_task = staticmethod(run_task)
