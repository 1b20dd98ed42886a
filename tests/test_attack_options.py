"""Every registered attack declares its options: a typo or a value of the wrong type is refused at
construction, in one line naming the key and the allowed options; `veil attack` and scenario
validation run the same check, `veil list --details` shows the declaration."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from veil.attacks import attack_options, create_attack, list_attacks, options_type
from veil.attacks.options import Options, check_listed, specs
from veil.commands.catalog import load as load_catalog
from veil.errors import VeilError

ROOT = Path(__file__).resolve().parent.parent
BAD_TYPE = {"not": "a value"}  # a mapping fits no declared option type


def _one_line(e: pytest.ExceptionInfo) -> str:
    text = str(e.value)
    assert "\n" not in text
    return text


@pytest.mark.parametrize("name", list_attacks())
def test_attack_rejects_a_typo_naming_the_allowed_options(name: str) -> None:
    cls = options_type(name)
    fields = [f.name for f in dataclasses.fields(cls)]
    typo = (fields[0] + "x") if fields else "iteratons"
    with pytest.raises(VeilError) as e:
        create_attack(name, **{typo: 1})
    text = _one_line(e)
    assert repr(typo) in text
    for f in fields:
        assert f in text
    if fields:
        assert f"did you mean {fields[0]!r}" in text


@pytest.mark.parametrize("name", list_attacks())
def test_attack_rejects_a_wrong_type_in_one_line(name: str) -> None:
    cls = options_type(name)
    typed = [k for k, s in specs(cls).items() if s != "any"]
    if not typed:
        assert not dataclasses.fields(cls) or pytest.fail(f"{name}: no option has a checked type")
        return
    with pytest.raises(VeilError) as e:
        create_attack(name, **{typed[0]: BAD_TYPE})
    text = _one_line(e)
    assert f"option {typed[0]!r} must be" in text and "options:" in text


@pytest.mark.parametrize("name", list_attacks())
def test_attack_declares_options_listed_with_defaults_and_help(name: str) -> None:
    cls = options_type(name)
    assert issubclass(cls, Options) and dataclasses.is_dataclass(cls)
    declared = attack_options(name)
    for opt in declared.values():
        assert opt.help, f"{name}.{opt.name} has no help line"
    defaults = create_attack(name).options
    assert dataclasses.asdict(defaults) == {k: o.default for k, o in declared.items()}


def test_values_are_converted_to_the_declared_type() -> None:
    ig = create_attack("ig", tv="1e-3", lr=1, iterations=7)  # YAML reads 1e-3 as a string
    assert ig.options.tv == 1e-3 and isinstance(ig.options.lr, float) and ig.options.iterations == 7
    with pytest.raises(VeilError, match="option 'iterations' must be int, got 2.5"):
        create_attack("ig", iterations=2.5)
    with pytest.raises(VeilError, match="option 'signed' must be bool"):
        create_attack("ig", signed="yes")


def test_catalog_check_matches_the_attacks() -> None:
    attacks = load_catalog()["kinds"]["attacks"]
    check_listed("ig", {"iterations": 5}, attacks)
    with pytest.raises(VeilError, match="ig: unknown option 'iteratons' .did you mean 'iterations'.."):
        check_listed("ig", {"iteratons": 5}, attacks)
    with pytest.raises(VeilError, match="unknown attack 'igg'"):
        check_listed("igg", {}, attacks)
    with pytest.raises(
        VeilError, match="multi-round: unknown option 'iteratons' .did you mean 'iterations'..; options: attack, "
    ):
        check_listed("multi-round", {"iteratons": 5}, attacks)
    check_listed("multi-round", {"attack": "dlg", "optimizer": "adam"}, attacks)


def test_cli_typo_exits_2_at_once_in_one_line(tmp_path: Path) -> None:
    load_catalog()  # a stale catalog is rebuilt once into the user cache (a release ships it current)
    # `veil attack ...` run as `python -m veil.cli`, reporting on stdout at exit which heavy modules
    # the process imported: the refusal must come before any of them (work counted, not timed)
    argv = [
        "veil",
        "attack",
        "configs/vit_digits.yaml",
        "--attack",
        "ig",
        "attack.iteratons=5",
        "--out",
        str(tmp_path / "x"),
    ]
    probe = (
        "import atexit, runpy, sys\n"
        f"sys.argv = {argv!r}\n"
        "heavy = ('torch', 'transformers', 'flwr', 'veil.models', 'veil.data', 'veil.attacks.base')\n"
        "atexit.register(lambda: print('imported:', sorted(m for m in sys.modules if m in heavy)))\n"
        "runpy.run_module('veil.cli', run_name='__main__', alter_sys=True)\n"
    )
    # the timeout is a safety net for a hung child, not the check
    r = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "iteratons" in lines[0] and "iterations" in lines[0], r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "x").exists()
    assert r.stdout.strip() == "imported: []", f"the typo was refused only after loading {r.stdout.strip()}"


def test_scenario_validation_refuses_a_bad_attack_option() -> None:
    from veil.experiments.scenario import parse_scenario

    task = {"name": "t", "run": {"model": "vit-digits", "data": "digits"}, "attacks": [{"name": "ig", "iteratons": 5}]}
    with pytest.raises(VeilError, match=r"tasks\[0\].attacks: ig: unknown option 'iteratons'") as e:
        parse_scenario({"tasks": [task]})
    _one_line(e)
    with pytest.raises(VeilError, match="scenario.attacks: ig: option 'restarts' must be int"):
        parse_scenario({"tasks": [{**task, "attacks": []}], "attacks": [{"name": "ig", "restarts": "two"}]})
