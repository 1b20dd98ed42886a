"""The peeling search's schedule as data (`veil.attacks.span.schedule`): docs/span.md shows the
declared table, every regime has a plan the stage loop can run, and the peeling cluster's
functions stay short (the issue's shape: no function over 40 lines)."""

from __future__ import annotations

import ast
from pathlib import Path

from veil.attacks.span.schedule import SCHEDULE, Member, Regime, regime, schedule_table
from veil.attacks.span.score import Objective

ROOT = Path(__file__).resolve().parents[1]
SPAN = ROOT / "src" / "veil" / "attacks" / "span"
#: the peeling search's modules (the other span modules have their own shape work)
PEELING = ("peel", "prefix", "suffix", "walks", "schedule", "strategy", "score", "checks", "residual", "mlp")


def test_docs_show_the_declared_schedule() -> None:
    assert schedule_table() in (ROOT / "docs" / "span.md").read_text()


def test_every_regime_has_a_plan_the_stage_loop_runs() -> None:
    """Before the loop: the members that propose once (pending hits first: an exact sentence found
    earlier costs one test); the loop: the walkers, alone or in turns with the prefix seeds; the
    reseeding rules: extend and cross seeds; merit weighting where layer 2 is crowded."""
    assert set(SCHEDULE) == set(Regime)
    for r, plan in SCHEDULE.items():
        assert plan.before[0] == Member.PENDING and set(plan.before) <= {Member.PENDING, Member.PREFIX, Member.SUFFIX}
        assert plan.loop in (Member.WALKERS, Member.TURNS) and set(plan.reseed) <= {Member.EXTEND, Member.CROSS}
        assert plan.merit == (r == Regime.CROWDED) and (Member.CROSS in plan.reseed) == (r != Regime.CROWDED)
    assert regime(Objective.LAYER2, True, False) == Regime.CROWDED
    assert regime(Objective.LAYER2, False, True) == Regime.LAYER2
    assert regime(Objective.MLP_GRADED, False, False) == Regime.MLP_GRADED


def test_no_function_of_the_peeling_search_is_over_40_lines() -> None:
    long = []
    for name in PEELING:
        tree = ast.parse((SPAN / f"{name}.py").read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                if n > 40:
                    long.append(f"{name}.{node.name}: {n}")
    assert not long, long
