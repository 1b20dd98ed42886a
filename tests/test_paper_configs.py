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
