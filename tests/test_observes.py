"""What an attack observes is declared once (`Attack.observes`, from `veil.attacks.base.OBSERVES`)
and every engine reads that declaration: no engine package (experiments, federated, report)
decides by an attack's name."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from veil.attacks import attacks_observing, create_attack, list_attacks
from veil.attacks.base import OBSERVES, PROTOCOL_VIEWS, Attack, protocols_for
from veil.registry import ATTACKS

SRC = Path(__file__).resolve().parents[1] / "src" / "veil"
ENGINES = ("experiments", "federated", "report")
#: attack names that are also batch keys ("labels": the label tensor of a batch); such a literal is
#: an attack name only beside other attack names (a tuple or set of attacks) or in an equality test
BATCH_KEYS = frozenset({"labels"})


def _strings(node: ast.AST) -> list[str]:
    return [n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def attack_names_in(path: Path, names: set[str], root: Path = SRC) -> list[str]:
    """`file:line: 'name'` for every string literal in `path` that names a registered attack."""
    tree = ast.parse(path.read_text(), str(path))
    hits: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value in names and node.value not in BATCH_KEYS:
                hits.append((node.lineno, node.value))
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            found = [s for s in _strings(node) if s in names]
            if set(found) - BATCH_KEYS:
                hits += [(node.lineno, s) for s in found if s in BATCH_KEYS]
        elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.Eq, ast.NotEq)) for op in node.ops):
            operands = [node.left, *node.comparators]  # `x == "labels"`: a name test, not a key lookup
            hits += [(node.lineno, o.value) for o in operands if isinstance(o, ast.Constant) and o.value in BATCH_KEYS]
        elif isinstance(node, ast.Dict):
            keys = [k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)]
            if set(keys) & (names - BATCH_KEYS):
                hits += [(node.lineno, k) for k in keys if k in BATCH_KEYS]
    return [f"{path.relative_to(root)}:{line}: {name!r}" for line, name in sorted(set(hits))]


def test_no_engine_names_an_attack() -> None:
    names = set(list_attacks())
    files = [f for pkg in ENGINES for f in sorted((SRC / pkg).rglob("*.py"))]
    assert files, "the engine packages are where this test expects them"
    hits = [h for f in files for h in attack_names_in(f, names)]
    assert hits == [], "engines decide by Attack.observes, not by name:\n" + "\n".join(hits)


def test_the_name_check_catches_a_name_test(tmp_path: Path) -> None:
    names = {"april", "labels", "ig"}
    bad = tmp_path / "bad.py"
    bad.write_text(
        "SKIP = {'april': 'closed form'}\nPLAIN = ('ig', 'labels')\n"
        "def f(a, batch):\n    return a == 'labels' or batch['labels']\n"
    )
    got = [h.split(": ", 1)[1] for h in attack_names_in(bad, names, tmp_path)]
    assert got == ["'april'", "'ig'", "'labels'", "'labels'"], got
    fine = tmp_path / "fine.py"
    fine.write_text("def f(batch):\n    return batch['labels'], {'labels': 1, 'pixels': 2}\n")
    assert attack_names_in(fine, names, tmp_path) == []


@pytest.mark.parametrize("name", list_attacks())
def test_every_attack_declares_what_it_observes(name: str) -> None:
    cls = ATTACKS.factory(name)
    assert isinstance(cls.observes, frozenset) and cls.observes, f"{name} declares no observes"
    assert cls.observes <= set(OBSERVES), f"{name}: {sorted(cls.observes - set(OBSERVES))} not in OBSERVES"
    assert any("observes" in vars(c) for c in cls.__mro__ if c is not Attack)
    # the protocols follow from the views: none declared apart
    assert cls.protocols == protocols_for(cls.observes) and cls.protocols


def test_protocols_follow_from_the_views() -> None:
    assert protocols_for(frozenset({"gradient"})) == ("single-step", "fedsgd")
    assert protocols_for(frozenset({"delta"})) == ("fedavg",)
    assert protocols_for(frozenset({"features"})) == ("split",)
    assert protocols_for(frozenset({"rounds"})) == ("fedsgd", "fedavg")  # a server's memory: not one step
    assert set().union(*PROTOCOL_VIEWS.values()) <= set(OBSERVES)
    # a one-gradient attack does not apply to a FedAvg update, and says where it does
    reason = create_attack("april").applies(None, protocol="fedavg")
    assert reason is not None and "fedsgd" in reason
    assert attacks_observing("features") and all(
        ATTACKS.factory(n).protocols == ("split",) for n in attacks_observing("features")
    )


def test_an_unknown_view_is_refused_at_class_creation() -> None:
    with pytest.raises(TypeError, match="unknown view 'gradients'"):

        class _Typo(Attack):
            observes = frozenset({"gradients"})
