"""Every reproduction config in configs/paper/ is runnable: it validates (names, keys, attacks
that apply) without training, and says in its header which table it mirrors."""

from __future__ import annotations

from pathlib import Path

import pytest

PAPER = sorted((Path(__file__).parent.parent / "configs" / "paper").glob("*.yaml"))


def test_there_are_reproduction_configs() -> None:
    assert len(PAPER) >= 8


@pytest.mark.parametrize("path", PAPER, ids=lambda p: p.name)
def test_paper_config_validates(path: Path) -> None:
    header = path.read_text().split("\n", 3)
    assert header[0].startswith("# Mirrors") and "Scaled down" in path.read_text()
    if "split:" in path.read_text():
        from veil.federated.split.spec import load_split_spec

        load_split_spec(path, [])
        return
    from veil.experiments.audit import validate
    from veil.experiments.scenario import load_scenario

    validate(load_scenario(path))


def test_a_task_at_init_attacks_the_seeded_weights_and_trains_nothing(tmp_path: Path) -> None:
    """`weights: init` (the attack tables at init): no run folder, no utility, the cell attacks what
    `build_run` builds (APRIL rebuilds an undefended ViT's image exactly); `reference: shuffled`
    scores against MJP's shuffled input; a bad value is one line."""
    from veil.errors import VeilError
    from veil.experiments.audit import run_audit
    from veil.experiments.scenario import parse_scenario

    task = {"name": "init", "run": {"model": "vit-digits", "data": "digits"}, "weights": "init", "samples": 1}
    shuffled = {**task, "name": "shuffled", "reference": "shuffled", "defenses": [{"name": "mjp", "gamma": 0.27}]}
    s = run_audit(parse_scenario({"name": "x", "attacks": ["april"], "tasks": [task, shuffled]}), tmp_path, False)
    t = s["tasks"]["init"]
    assert t["weights"] == "init" and t["utility"] == {"none": {}} and not (tmp_path / "runs").exists()
    assert t["leakage"]["none"]["april"]["psnr"] > 80
    assert s["tasks"]["shuffled"]["reference"] == "shuffled"
    assert s["tasks"]["shuffled"]["leakage"]["mjp(gamma=0.27)"]["april"]["psnr"] < 30
    with pytest.raises(VeilError, match=r"tasks\[0\].weights must be one of trained, init, got 'random'"):
        parse_scenario({"tasks": [{**task, "weights": "random"}]})
