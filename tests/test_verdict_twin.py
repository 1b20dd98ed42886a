"""A failed attack is not protection: the verdict `holds` needs an attack that failed against the
defense to have succeeded on the undefended twin of the same task (same data, same budget);
otherwise the verdict is `unknown`, never `holds`."""

from __future__ import annotations

from typing import Any

from veil.metrics.leakage import worst_case
from veil.report.headline import SAYS, glance_blocks, verdict

KNOWS = {"april-mjp": "MJP's mechanism", "april": "naive", "ig": "naive"}


def _task(leak: dict[str, dict[str, Any]], blocked: dict[str, dict[str, str]] | None = None) -> dict[str, Any]:
    blocked = blocked or {}
    return {
        "model": "vit-digits",
        "data": "folder",
        "utility": {d: {"test_accuracy_mean": 0.5} for d in leak},
        "leakage": leak,
        "blocked": blocked,
        "worst_case": {d: worst_case(leak[d], KNOWS, blocked.get(d)) for d in leak},
    }


def _verdicts(t: dict[str, Any]) -> dict[str, str]:
    rows = [r for b in glance_blocks({"tasks": {"user-16px": t}}) if b[0] == "glance" for r in b[2]]
    return {r[0]: r[3] for r in rows}


def test_an_attack_that_fails_on_the_undefended_twin_too_gives_unknown() -> None:
    """The 16x16 case of the issue: april-mjp rebuilds noise on the undefended model as on MJP."""
    t = _task({"none": {"april-mjp": {"psnr": 6.5}}, "mjp(gamma=0.27)": {"april-mjp": {"psnr": 6.2}}})
    got = _verdicts(t)
    assert got["mjp(gamma=0.27)"] == "unknown"
    assert got["none"] == "unknown"  # an attack that fails undefended is no evidence of anything
    assert "failed on the undefended model too" in SAYS["unknown"]


def test_holds_where_the_same_attack_succeeded_undefended() -> None:
    t = _task({"none": {"april-mjp": {"psnr": 62.4}}, "mjp(gamma=0.27)": {"april-mjp": {"psnr": 6.2}}})
    assert _verdicts(t) == {"none": "leaks", "mjp(gamma=0.27)": "holds"}


def test_another_attack_succeeding_undefended_is_not_the_twin() -> None:
    """ig failed on both; april succeeded undefended but was not run against the defense."""
    t = _task({"none": {"april": {"psnr": 119.0}, "ig": {"psnr": 7.0}}, "dp": {"ig": {"psnr": 6.9}}})
    assert _verdicts(t)["dp"] == "unknown"


def test_a_blocked_attack_that_works_undefended_still_holds() -> None:
    t = _task({"none": {"april": {"psnr": 119.0}}, "aegis": {}}, {"aegis": {"april": "frozen"}})
    assert _verdicts(t)["aegis"] == "holds"


def test_no_undefended_twin_is_unknown_not_holds() -> None:
    t = _task({"mjp(gamma=0.27)": {"april-mjp": {"psnr": 6.2}}})
    assert _verdicts(t)["mjp(gamma=0.27)"] == "unknown"
    assert verdict(t["worst_case"]["mjp(gamma=0.27)"]) == "holds"  # the band alone, without a twin


def test_the_glance_names_the_step_of_the_weights_attacked() -> None:
    t = _task({"none": {"april": {"psnr": 119.0}}})
    t["utility"]["none"]["weights"] = {"checkpoint": "final", "steps": [120]}
    rows = [r for b in glance_blocks({"tasks": {"x": t}}) if b[0] == "glance" for r in b[2]]
    assert rows[0][1] == "accuracy 0.500 (the reference), final model at step 120"


def test_a_real_audit_whose_attack_fails_undefended_says_unknown(tmp_path) -> None:  # noqa: ANN001
    """End to end at init on digits: IG cut to 2 steps rebuilds noise with and without MJP, so
    MJP's verdict is unknown, not holds; APRIL, which rebuilds the undefended image, keeps the
    other task's MJP verdict meaningful (leaks or holds, never unknown)."""
    from veil.experiments.audit import run_audit
    from veil.experiments.scenario import parse_scenario
    from veil.report.headline import task_verdict

    run = {"model": {"name": "vit-digits", "depth": 1, "dim": 32, "heads": 2}, "data": {"name": "digits"}}
    task = {"run": run, "defenses": ["none", {"name": "mjp", "gamma": 0.27}], "samples": 1, "weights": "init"}
    raw = {
        "name": "twin",
        "tasks": [
            {**task, "name": "weak", "attacks": [{"name": "ig", "iterations": 2, "restarts": 1}]},
            {**task, "name": "strong", "attacks": ["april"]},
        ],
    }
    summary = run_audit(parse_scenario(raw), tmp_path / "a", progress=False, jobs=1)
    weak, strong = summary["tasks"]["weak"], summary["tasks"]["strong"]
    assert weak["leakage"]["none"]["ig(iterations=2,restarts=1)"]["psnr"] < 12  # failed undefended too
    assert task_verdict(weak, "mjp(gamma=0.27)") == "unknown"
    assert task_verdict(weak, "none") == "unknown"
    assert task_verdict(strong, "none") == "leaks"
    assert task_verdict(strong, "mjp(gamma=0.27)") in ("leaks", "partly", "holds")
