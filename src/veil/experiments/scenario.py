"""Audit scenarios: one YAML naming the tasks, defenses, protocol, attacks, attacker knowledge
and seeds. Everything is validated before any training — a bad scenario fails in one line.

    name: quickstart
    seeds: [0]
    attacks: [labels]                    # optional: run wherever they apply, skipped elsewhere
    tasks:
      - name: digits-vit
        run: {model: vit-digits, data: digits, train: {epochs: 20}}   # a RunConfig
        protocol: single-step            # single-step | fedavg | split
        defenses: [none, {name: mjp, gamma: 0.1}]
        attacks: [april, {name: ig, iterations: 200}]   # must apply to this task
        knowledge: {labels: true, batch_size: 1}
        samples: 4                       # attacked client steps per cell
        weights: trained                 # trained | init: attack the seeded initial weights (no training)
        reference: original              # original | shuffled: score against the input MJP's shuffle made
        evaluate: {test_shuffle: [0.1, 0.27], pe: 10}   # after training (veil.experiments.evaluations)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from veil.attacks import check_attack
from veil.attacks.options import check_device
from veil.config import RunConfig, from_dict, read_yaml, resolve_paths
from veil.errors import VeilError
from veil.experiments.evaluation_keys import check_evaluations
from veil.registry import PROTOCOLS

TASK_KEYS = {
    "name",
    "run",
    "protocol",
    "defenses",
    "attacks",
    "knowledge",
    "samples",
    "federated",
    "weights",
    "reference",
    "evaluate",
    "canaries",
}
WEIGHTS = ("trained", "init")
REFERENCES = ("original", "shuffled")
SCENARIO_KEYS = {"name", "seeds", "tasks", "description", "attacks", "attack"}
#: the attack phase's settings (`scenario.attack`): where it runs (`veil.attacks.options.DEVICES`)
ATTACK_PHASE_KEYS = {"device"}
KNOWLEDGE_KEYS = {"labels", "batch_size", "seq_len", "defense"}


@dataclass
class Task:
    name: str
    run: RunConfig
    protocol: str = "single-step"
    defenses: list[dict[str, Any]] = field(default_factory=lambda: [{"name": "none"}])
    attacks: list[dict[str, Any]] = field(default_factory=list)
    knowledge: dict[str, Any] = field(default_factory=dict)
    samples: int = 2
    federated: dict[str, Any] = field(default_factory=dict)
    #: "init": the cells attack the run's seeded initial weights, nothing is trained (no utility)
    weights: str = "trained"
    #: what a reconstruction is scored against: the private input, or the input as MJP shuffled it
    reference: str = "original"
    #: evaluations of each trained run beyond its test accuracy (`veil.experiments.evaluations`)
    evaluate: dict[str, Any] = field(default_factory=dict)
    #: a dp-audit task's canary and membership options (`veil.experiments.dp_audit.OPTIONS`)
    canaries: dict[str, Any] = field(default_factory=dict)

    def run_for(self, defense: dict[str, Any], seed: int) -> RunConfig:
        """The task's run with one defense and one seed."""
        raw = self.run.to_dict()
        raw["defense"] = [] if defense["name"] == "none" else [defense]
        raw["train"]["seed"] = seed
        return from_dict(raw)


@dataclass
class Scenario:
    name: str
    seeds: list[int]
    tasks: list[Task]
    raw: dict[str, Any]
    #: attacks run on every task where they apply (skipped, with the reason, where not);
    #: a task's own `attacks` must apply to it, or the scenario is refused
    attacks: list[dict[str, Any]] = field(default_factory=list)
    #: where the attack phase runs: auto (CUDA when present) | cpu | cuda; the CPU's numbers do not
    #: depend on it
    device: str = "auto"


def label(entry: dict[str, Any]) -> str:
    """A short stable name for a defense or attack entry: mjp, mjp(gamma=0.1)."""
    extra = ",".join(f"{k}={v}" for k, v in sorted(entry.items()) if k != "name")
    return f"{entry['name']}({extra})" if extra else entry["name"]


def _entries(value: Any, what: str, where: str) -> list[dict[str, Any]]:
    items = value if isinstance(value, list) else [value]
    out = []
    for v in items:
        if isinstance(v, str):
            out.append({"name": v})
        elif isinstance(v, dict) and isinstance(v.get("name"), str):
            out.append(dict(v))
        else:
            raise VeilError(f"{where}.{what} entries must be names or mappings with a 'name' key, got {v!r}")
        if what == "attacks":  # its name and options, as the attack declares them (one line if bad)
            check_attack(out[-1], f"{where}.attacks")
    return out


def _unknown(keys: set[str], allowed: set[str], where: str) -> None:
    bad = sorted(keys - allowed)
    if bad:
        raise VeilError(f"unknown key '{where}.{bad[0]}'; allowed: {', '.join(sorted(allowed))}")


def parse_task(raw: Any, index: int) -> Task:
    where = f"tasks[{index}]"
    if not isinstance(raw, dict):
        raise VeilError(f"{where} must be a mapping")
    _unknown(set(raw), TASK_KEYS, where)
    name = raw.get("name") or f"task{index}"
    if "run" not in raw:
        raise VeilError(f"{where} ({name}) has no 'run' section (model, data, train)")
    protocol = raw.get("protocol", "single-step")
    if protocol != "single-step" and protocol not in PROTOCOLS:
        raise VeilError(
            f"unknown protocol '{protocol}' in {where}; allowed: single-step, {', '.join(PROTOCOLS.names())}"
        )
    knowledge = raw.get("knowledge") or {}
    _unknown(set(knowledge), KNOWLEDGE_KEYS, f"{where}.knowledge")
    samples = raw.get("samples", 2)
    if not isinstance(samples, int) or samples < 1:
        raise VeilError(f"{where}.samples must be a positive integer, got {samples!r}")
    for key, allowed in (("weights", WEIGHTS), ("reference", REFERENCES)):
        if raw.get(key, allowed[0]) not in allowed:
            raise VeilError(f"{where}.{key} must be one of {', '.join(allowed)}, got {raw[key]!r}")
    if raw.get("canaries") is not None and (protocol != "dp-audit" or not isinstance(raw["canaries"], dict)):
        raise VeilError(
            f"{where}.canaries applies to protocol: dp-audit tasks only, as a mapping (this task: {protocol})"
        )
    if raw.get("weights") == "init" and protocol != "single-step":
        raise VeilError(f"{where}.weights: init applies to single-step tasks only (a {protocol} task trains)")
    try:
        run = from_dict(raw["run"])
    except VeilError as e:
        raise VeilError(f"{where} ({name}): {e}") from None
    return Task(
        name=str(name),
        run=run,
        protocol=protocol,
        defenses=_entries(raw.get("defenses", ["none"]), "defenses", where),
        attacks=_entries(raw.get("attacks", []), "attacks", where),
        knowledge=dict(knowledge),
        samples=samples,
        federated=dict(raw.get("federated") or {}),
        weights=raw.get("weights", "trained"),
        reference=raw.get("reference", "original"),
        evaluate=check_evaluations(raw.get("evaluate") or {}, where),
        canaries=dict(raw.get("canaries") or {}),
    )


def parse_scenario(raw: Any, default_name: str = "scenario") -> Scenario:
    if (
        isinstance(raw, dict) and "split" in raw and "tasks" not in raw
    ):  # a `veil split` run config: its protocols, audited
        raw = PROTOCOLS.create("split").scenario_from_run_config(raw, default_name)
    if not isinstance(raw, dict):
        raise VeilError("a scenario must be a YAML mapping with keys: " + ", ".join(sorted(SCENARIO_KEYS)))
    _unknown(set(raw), SCENARIO_KEYS, "scenario")
    seeds = raw.get("seeds", [0])
    if not isinstance(seeds, list) or not seeds or not all(isinstance(s, int) for s in seeds):
        raise VeilError(f"scenario.seeds must be a non-empty list of integers, got {seeds!r}")
    tasks = raw.get("tasks")
    if not isinstance(tasks, list) or not tasks:
        raise VeilError("scenario.tasks must be a non-empty list")
    parsed = [parse_task(t, i) for i, t in enumerate(tasks)]
    names = [t.name for t in parsed]
    if len(set(names)) != len(names):
        raise VeilError(f"task names must be unique, got {names}")
    attacks = _entries(raw.get("attacks", []), "attacks", "scenario")
    phase = raw.get("attack") or {}
    if not isinstance(phase, dict):
        raise VeilError(f"scenario.attack must be a mapping such as {{device: auto}}, got {phase!r}")
    _unknown(set(phase), ATTACK_PHASE_KEYS, "scenario.attack")
    device = check_device(phase.get("device", "auto"))
    return Scenario(
        name=str(raw.get("name", default_name)), seeds=seeds, tasks=parsed, raw=raw, attacks=attacks, device=device
    )


def default_scenario_path() -> Path:
    return Path(__file__).resolve().parent.parent / "configs" / "quickstart.yaml"


def load_scenario(path: str | Path | None) -> Scenario:
    p = Path(path) if path is not None else default_scenario_path()
    raw = read_yaml(p, "scenario")
    tasks = raw.get("tasks")
    runs = (
        [t["run"] for t in tasks if isinstance(t, dict) and isinstance(t.get("run"), dict)]
        if isinstance(tasks, list)
        else [raw]
    )
    for run in runs:  # a task's relative paths name files beside the scenario
        resolve_paths(run, p.resolve().parent)
    return parse_scenario(raw, default_name=p.stem)


def dump_scenario(s: Scenario) -> str:
    return yaml.safe_dump(s.raw, sort_keys=False)
