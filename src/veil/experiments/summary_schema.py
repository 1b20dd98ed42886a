"""The shape of summary.json, typed: what the engines fill (`veil.experiments.summary`, the
protocols' `run_task`) and the report reads (`veil.report`). `SCHEMA` is written as
``summary["schema"]``; a change of a key's name or meaning raises it, a new key does not.

The tables inside a task are keyed by defense label, then by attack label
(``leakage[defense][attack][metric]``); their cells stay mappings from metric name to number,
as each attack reports its own metrics (`veil.attacks.harness.score`).
"""

from __future__ import annotations

from typing import Any, TypedDict

#: the version of this layout, in summary.json as ``schema``
SCHEMA = 1

Metrics = dict[str, float]  # metric name -> value (one attack cell, or a budget account)
ByAttack = dict[str, Metrics]  # attack label -> its metrics
ByDefense = dict[str, ByAttack]  # defense label -> attack label -> metrics


class TaskSummary(TypedDict, total=False):
    """``summary["tasks"][task]``: what was trained and attacked, then the tables (see
    `veil.experiments.summary` for each one's meaning). The common keys are set by `task_entry`
    for every protocol; the protocol-specific tables only where that protocol fills them."""

    model: str
    data: str
    protocol: str  # single-step | fedavg | split | dp-audit
    dropout: float
    knowledge: dict[str, Any]
    samples: int
    weights: str  # single-step: "trained" | "init"
    reference: str  # single-step: "original" | "shuffled"
    canaries: dict[str, Any]  # dp-audit: its options
    utility: dict[str, dict[str, Any]]  # defense -> test accuracy mean / std / values, privacy, ...
    leakage: ByDefense
    skipped: dict[str, str]  # attack -> why it did not apply
    blocked: dict[str, dict[str, str]]  # defense -> attack -> why the defense closed its channel
    overhead: dict[str, float]  # defense -> step time relative to no defense
    overhead_spread: dict[str, list[float]]  # defense -> quartiles of the step-by-step ratios
    step_seconds: dict[str, float]
    attacker_knows: dict[str, str]  # attack -> what it uses
    worst_case: dict[str, dict[str, Any]]  # defense -> the verdict (`veil.metrics.leakage.worst_case`)
    budget: ByDefense  # defense -> attack -> budget_used, budget_used_max, budget_stopped
    census: dict[str, Any]  # defense -> what the server sees, parameter by parameter
    federated: dict[str, Any]  # fedavg: the federated settings the runs used
    server_saw: list[str]  # fedavg: what the server saw of the audited updates
    figure: str  # fedavg: the per-round figure, relative to the audit folder
    rounds: dict[str, list[dict[str, Any]]]  # fedavg: defense -> per round
    clients: dict[str, dict[str, Any]]  # fedavg: defense -> per audited client
    bytes: dict[str, dict[str, float]]  # fedavg: defense -> bytes_total, bytes_per_round
    split: dict[str, Any]  # split: protocol -> bytes and feature attacks
    dp_audit: dict[str, Any]  # dp-audit: the one-run audit's numbers
    membership: dict[str, Any]  # dp-audit: the membership attack's numbers


class AuditSummary(TypedDict, total=False):
    """summary.json of `veil audit`."""

    schema: int  # `SCHEMA`
    scenario: str
    seeds: list[int]
    tasks: dict[str, TaskSummary]
    versions: dict[str, str]  # python, platform, veil, torch, ...
    config: dict[str, Any]  # the scenario as given
    over_budget: list[str]  # `veil.experiments.summary.over_budget`


def task_keys() -> frozenset[str]:
    """Every key a task entry may hold."""
    return frozenset(TaskSummary.__annotations__)


def summary_keys() -> frozenset[str]:
    """Every top-level key of summary.json."""
    return frozenset(AuditSummary.__annotations__)
