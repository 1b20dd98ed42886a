"""Every reproduction config in configs/paper/ is runnable: it validates (names, keys, attacks
that apply) without training, and says in its header which table it mirrors."""

from __future__ import annotations

from pathlib import Path

import pytest

PAPER = sorted((Path(__file__).parent.parent / "configs" / "paper").glob("*.yaml"))


def test_there_are_reproduction_configs() -> None:
    assert len(PAPER) >= 8


@pytest.mark.parametrize("path", PAPER, ids=lambda p: p.name)
def test_paper_config_validates(path: Path, tmp_path: Path) -> None:
    header = path.read_text().split("\n", 3)
    assert header[0].startswith("# Mirrors") and "Scaled down" in path.read_text()
    if "split:" in path.read_text():
        from veil.federated.split.spec import load_split_spec

        load_split_spec(path, [])
        return
    from veil.experiments.audit import validate
    from veil.experiments.scenario import load_scenario

    scenario = load_scenario(path)
    for task in scenario.tasks:  # a checkpoint that `veil pretrain` writes first, as the header says
        init = task.run.model.get("init")
        if init and not (Path(init) / "pretrained.json").is_file():
            assert f"--out {init}" in path.read_text(), f"{path.name}: say how {init} is made"
            task.run.model = {k: v for k, v in task.run.model.items() if k != "init"}  # the rest still checked
        data_path = task.run.data.get("path")
        if data_path and not Path(data_path).exists():  # a reproduction's data outside the repository
            assert "point `path` at" in path.read_text(), f"{path.name}: say where {data_path} comes from"
            task.run.data = {**task.run.data, "path": str(_stand_in(tmp_path, data_path))}  # the rest still checked
    validate(scenario)


def _stand_in(tmp: Path, data_path: str) -> Path:
    """A small SST-2-shaped folder (train.tsv, test.tsv: sentence<TAB>label) where a reproduction's
    data is not on this machine, or its file when the config names one."""
    rows = "sentence\tlabel\n" + "".join(
        f"a {'good' if i % 2 else 'bad'} film number {i}\t{i % 2}\n" for i in range(6000)
    )
    folder = tmp / "stand-in"
    folder.mkdir(exist_ok=True)
    for name in ("train.tsv", "test.tsv"):
        (folder / name).write_text(rows)
    return folder / Path(data_path).name if data_path.endswith(".tsv") else folder


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
    untrained = {"none": {"weights": {"checkpoint": "init", "steps": [0]}}}  # no accuracy: only the weights named
    assert t["weights"] == "init" and t["utility"] == untrained and not (tmp_path / "runs").exists()
    assert t["leakage"]["none"]["april"]["psnr"] > 80
    assert s["tasks"]["shuffled"]["reference"] == "shuffled"
    assert s["tasks"]["shuffled"]["leakage"]["mjp(gamma=0.27)"]["april"]["psnr"] < 30
    from veil.report.render import write_reports

    write_reports(s, tmp_path)  # the report says the task trained nothing instead of failing on its accuracy
    assert "not trained (attacked at its initial weights)" in (tmp_path / "report.md").read_text()
    with pytest.raises(VeilError, match=r"tasks\[0\].weights must be one of trained, init, got 'random'"):
        parse_scenario({"tasks": [{**task, "weights": "random"}]})


def test_a_task_evaluates_its_runs_under_test_time_shuffle_and_pca(tmp_path: Path) -> None:
    """`evaluate: {test_shuffle, pe}` (MJP Fig. 4 and Table XII): each trained run is evaluated after
    training, cached in its folder, and the summary holds the mean over seeds; G = 0 is the clean
    accuracy; a bad key is one line."""
    from veil.errors import VeilError
    from veil.experiments.audit import run_audit
    from veil.experiments.scenario import parse_scenario

    run = {"model": "vit-digits", "data": {"name": "digits"}, "train": {"epochs": 6, "batch_size": 64, "lr": 0.003}}
    task = {"name": "d", "run": run, "evaluate": {"test_shuffle": [0.0, 0.5], "pe": 3}}
    s = run_audit(parse_scenario({"name": "x", "tasks": [task]}), tmp_path, False)
    u = s["tasks"]["d"]["utility"]["none"]
    assert u["evaluations"]["test_shuffle"]["0"] == u["test_accuracy_mean"]
    assert u["evaluations"]["test_shuffle"]["0.5"] < u["test_accuracy_mean"]
    ev = u["evaluations"]["pe"]
    assert list(ev) == ["1", "2", "3"] and 0 < ev["1"] < ev["2"] < ev["3"] <= 100
    assert (tmp_path / "runs" / "d" / "none" / "seed0" / "evaluations.json").is_file()
    with pytest.raises(VeilError, match=r"tasks\[0\].evaluate: unknown \['pca'\]; allowed: test_shuffle, pe"):
        parse_scenario({"tasks": [{**task, "evaluate": {"pca": 3}}]})
