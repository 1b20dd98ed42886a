"""`veil audit`: a tiny scenario end to end, its report against summary.json, resume, bad scenarios."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from veil.commands.audit import audit as run_audit  # the engine, then the report
from veil.errors import VeilError
from veil.experiments.scenario import load_scenario, parse_scenario

TINY = {
    "name": "tiny",
    "seeds": [0],
    "attacks": ["labels", "presence"],
    "tasks": [
        {
            "name": "digits",
            "run": {
                "model": {"name": "vit-digits", "depth": 1, "dim": 32, "heads": 2},
                "data": {"name": "digits", "train_size": 200, "test_size": 40},
                "train": {"epochs": 1, "batch_size": 64},
            },
            "defenses": ["none", {"name": "mjp", "gamma": 0.1}],
            "attacks": ["april"],
            "knowledge": {"batch_size": 1},
            "samples": 1,
        },
        {
            "name": "text",
            "run": {
                "model": {"name": "transformer4", "depth": 2},
                "data": {"name": "sst2", "tokenizer": "word", "max_len": 12, "train_size": 100, "test_size": 20},
                "train": {"epochs": 1, "batch_size": 32},
            },
            "defenses": ["none", "aegis"],
            "attacks": ["span"],
            "knowledge": {"labels": True, "batch_size": 1},
            "samples": 1,
        },
    ],
}


@pytest.fixture(scope="module")
def audit(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("audit")
    summary = run_audit(parse_scenario(TINY), out, progress=False)
    return out, summary


def test_report_matches_summary(audit: tuple[Path, dict]) -> None:
    out, summary = audit
    assert json.loads((out / "summary.json").read_text()) == json.loads(json.dumps(summary))
    md = (out / "report.md").read_text()
    html = (out / "report.html").read_text()
    digits = summary["tasks"]["digits"]
    for u in digits["utility"].values():  # one seed: the accuracy alone, no "± 0.0000"
        assert f"| {u['test_accuracy_mean']:.4f} |" in md and "± 0.0000" not in md
    psnr = digits["leakage"]["none"]["april"]["psnr"]
    assert psnr > 40  # APRIL rebuilds the undefended image
    assert f"| {psnr:.1f} |" in md or "| exact (∞) |" in md
    assert digits["leakage"]["mjp(gamma=0.1)"]["april"]["psnr"] < psnr
    text = summary["tasks"]["text"]
    assert text["leakage"]["none"]["presence"]["presence_f1"] > 0.99
    assert "presence" in text["leakage"]["aegis"]
    assert text["leakage"]["none"]["span"]["token_recovery"] > 0.9  # the span attack reads the undefended update
    assert "span" in text["blocked"]["aegis"]  # AEGIS froze the layer it reads: recorded, not a crash
    assert "Blocked: `span`" in md
    census = text["census"]["aegis"]["tensors"]  # what the server sees, tensor by tensor
    assert census["blocks.0.attn.q.weight"]["state"] == "frozen" and census["tok.weight"]["state"] == "noised"
    assert census["blocks.0.mlp.fc2.weight"]["state"] == "noised" and census["head.weight"]["state"] == "clean"
    assert text["census"]["none"]["tensors"]["blocks.0.attn.q.weight"]["read_by"] == ["span"]
    assert "What the server sees" in md and "`blocks.*.mlp.fc2.weight` (2)" in md
    assert (
        "presence" in digits["skipped"]
    )  # a scenario-wide attack that does not fit images is skipped, with its reason
    assert "data:image/png;base64," in html and "<table>" in html
    assert "torch" in summary["versions"]


def test_summary_leads_with_the_worst_case(audit: tuple[Path, dict]) -> None:
    from veil.metrics.leakage import KEYS

    out, summary = audit
    for t in summary["tasks"].values():
        assert set(t["worst_case"]) == set(t["utility"])  # one verdict per task x defense
        assert all(tuple(wc) == KEYS and wc["attack"] in t["leakage"][d] for d, wc in t["worst_case"].items())
    none = summary["tasks"]["digits"]["worst_case"]["none"]
    assert none["attack"] == "april" and none["value"] == summary["tasks"]["digits"]["leakage"]["none"]["april"]["psnr"]
    assert none["knows"] == summary["tasks"]["digits"]["attacker_knows"]["april"]
    aegis = summary["tasks"]["text"]["worst_case"]["aegis"]
    assert "span" in aegis["blocked"] and aegis["attack"] == "presence"  # blocked span beside what still worked
    md = (out / "report.md").read_text()
    task = md.index("## Task `digits`")
    assert task < md.index("### Worst case per defense", task) < md.index("### Utility and cost", task)


def test_rerun_recomputes_nothing(audit: tuple[Path, dict]) -> None:
    out, summary = audit
    stamps = {p: p.stat().st_mtime_ns for p in (out / "cells").rglob("*.json")}
    stamps.update({p: p.stat().st_mtime_ns for p in (out / "runs").rglob("*.safetensors")})
    again = run_audit(parse_scenario(TINY), out, progress=False)
    assert again == json.loads(json.dumps(summary))
    assert all(p.stat().st_mtime_ns == t for p, t in stamps.items())


@pytest.mark.slow  # the default run keeps test_federated_audit's killed audit and test_resume's SIGKILLed run
def test_killed_audit_resumes_with_identical_numbers(audit: tuple[Path, dict], tmp_path: Path) -> None:
    out, summary = audit
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0"}
    scenario = tmp_path / "tiny.yaml"
    scenario.write_text(yaml.safe_dump(TINY))
    cmd = [sys.executable, "-m", "veil.cli", "audit", str(scenario), "--out", str(tmp_path / "a"), "--quiet"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    # kill it once the first run has finished training
    import time

    deadline = time.time() + 300  # a safety net for a run that never finishes, not the check
    while time.time() < deadline and not list((tmp_path / "a").rglob("summary.json")):
        time.sleep(0.5)
    proc.kill()
    proc.wait()
    assert not (tmp_path / "a" / "report.html").exists()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    resumed = json.loads((tmp_path / "a" / "summary.json").read_text())
    timing = {"seconds", "iterations_per_second"}

    def leakage(s: dict) -> dict:  # every leakage number but wall-clock timings
        return {
            t: {
                d: {a: {m: v for m, v in cell.items() if m not in timing} for a, cell in att.items()}
                for d, att in task["leakage"].items()
            }
            for t, task in s["tasks"].items()
        }

    assert leakage(resumed) == leakage(json.loads(json.dumps(summary)))
    for t in summary["tasks"]:
        for d, u in summary["tasks"][t]["utility"].items():
            assert resumed["tasks"][t]["utility"][d]["test_accuracy_values"] == u["test_accuracy_values"]


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda s: s["tasks"][0].update(defenses=["none", "magic"]), "unknown defense 'magic'"),
        (lambda s: s["tasks"][0].update(attacks=["span"]), "attack 'span' does not apply to task 'digits'"),
        (lambda s: s["tasks"][0]["run"]["data"].update(name="image_folder", path="/nowhere/at/all"), "does not exist"),
        (lambda s: s["tasks"][0].update(atacks=["april"]), "unknown key 'tasks[0].atacks'"),
        (lambda s: s["tasks"][0]["run"]["train"].update(epocs=1), "unknown config key 'train.epocs'"),
        (lambda s: s.update(seeds=[]), "scenario.seeds must be a non-empty list"),
        (lambda s: s["tasks"][0].update(protocol="gossip"), "unknown protocol 'gossip'"),
        (lambda s: s["tasks"][0].update(attacks=["aprill"]), "unknown attack 'aprill'"),
    ],
)
def test_bad_scenario_fails_before_training(tmp_path: Path, change, message: str) -> None:
    raw = json.loads(json.dumps(TINY))
    change(raw)
    with pytest.raises(VeilError) as e:
        run_audit(parse_scenario(raw), tmp_path / "out", progress=False)
    assert message in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "out" / "runs").exists()


def test_embedded_quickstart_parses() -> None:
    s = load_scenario(None)
    assert s.name == "quickstart" and {t.name for t in s.tasks} == {"digits-vit", "sst2-text"}


@pytest.mark.slow  # the default run keeps test_audit_frozen's two-worker audit (same numbers as a run alone)
def test_a_parallel_audit_gives_the_sequential_numbers(audit: tuple[Path, dict], tmp_path: Path) -> None:
    """--jobs 2 trains the runs and attacks the cells in two worker processes; every number but the
    wall-clock timings equals the sequential audit's."""
    out, summary = audit
    par = run_audit(parse_scenario(TINY), tmp_path / "par", progress=False, jobs=2)

    def numbers(x: Any) -> Any:
        if isinstance(x, dict):
            return {k: numbers(v) for k, v in x.items() if "second" not in k and k not in ("overhead", "versions")}
        return [numbers(v) for v in x] if isinstance(x, list) else x

    assert numbers(json.loads(json.dumps(par))["tasks"]) == numbers(json.loads(json.dumps(summary))["tasks"])


def test_the_engine_writes_the_summary_and_no_report(audit: tuple[Path, dict], tmp_path: Path) -> None:
    """experiments.audit.run_audit is the engine alone: summary.json, reused cells; the report is
    rendered above it (veil.commands.audit.audit)."""
    from veil.experiments.audit import run_audit as engine

    out, summary = audit
    copy = tmp_path / "copy"
    shutil.copytree(out, copy, ignore=shutil.ignore_patterns("report.*", "figures", ".veil.lock"))
    again = engine(parse_scenario(TINY), copy, progress=False)
    assert again == json.loads(json.dumps(summary))  # every run and cell reused
    assert (copy / "summary.json").is_file() and not (copy / "report.md").exists()
