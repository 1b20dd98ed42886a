"""The peeling search's schedule per objective (`veil.attacks.span.peel`), declared as data.

A stage of the peeling search (one sentence found on the current residual) runs the members of
`veil.attacks.span.strategy` in the order its `Plan` states: the `before` members once each, in
order, until one of them proposes a sentence that passes the exact test; then its `loop` until a
sentence passes or the budget is spent (the walkers alone, or the prefix seeds and the walkers in
turns), and after every walker step the first `reseed` rule that applies. Which plan a stage runs
is its `Regime`, read off the stage's objective (`score.Objective`), whether layer 2 is crowded,
and how full the MLP span is (`regime`). docs/span.md renders `SCHEDULE` (`schedule_table`).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from veil.attacks.span.score import Objective


class Regime(StrEnum):
    """The condition a stage starts in: its objective, refined by crowding and the MLP span's fill."""

    LAYER2 = "layer2"
    CROWDED = "layer2, crowded"
    MLP = "mlp"
    MLP_NEAR = "mlp, near its limit"
    MLP_GRADED = "mlp-graded"


class Member(StrEnum):
    """The members of the search (`veil.attacks.span.strategy`) a plan names."""

    PENDING = "pending hits"  # exact sentences an earlier stage found beside the one it peeled, re-tested
    PREFIX = "prefix seeds"  # `veil.attacks.span.prefix`
    SUFFIX = "suffix growth"  # `veil.attacks.span.suffix`
    WALKERS = "walkers"  # `veil.attacks.span.walks`, fair share of work between the lengths
    TURNS = "prefix seeds and walkers in turns"  # one first token's prefix seeds, then as much walker work
    EXTEND = "extend seeds"  # a graded walk's new lowest best restarts lengths n - 1, n + 1, n + 2
    CROSS = "cross seeds"  # every other kick starts from another length's best content


@dataclass(frozen=True)
class Plan:
    """What a stage in one `Regime` runs: `before` once each in order, then `loop`; after each
    walker step the first `reseed` member that applies; `merit`: the walkers' work is weighted by
    their best objective (`walks._merit`). `when` and `cost` are the documentation's columns."""

    when: str
    cost: str
    before: tuple[Member, ...]
    loop: Member
    reseed: tuple[Member, ...]
    merit: bool = False


SCHEDULE: dict[Regime, Plan] = {
    Regime.LAYER2: Plan(
        when="layer 2's span leaves >= `crowded` of the width free, and >= `mlp_codim` or no usable MLP span",
        cost="layer-2 span distance (1 block)",
        before=(Member.PENDING, Member.PREFIX, Member.SUFFIX),
        loop=Member.WALKERS,
        reseed=(Member.CROSS,),
    ),
    Regime.CROWDED: Plan(
        when="layer 2 leaves < `crowded` of the width free and no usable MLP span",
        cost="layer-2 distance + embedding-gradient match + `prior_weight` x position prior "
        "+ `cls_weight` x exact-test distance (every block, forward and backward)",
        before=(Member.PENDING,),
        loop=Member.WALKERS,
        reseed=(),
        merit=True,
    ),
    Regime.MLP: Plan(
        when="layer 2 leaves < `mlp_codim` free; the MLP span usable (<= `mlp_max_fill`), below `suffix_near` of its rank limit",
        cost="block-1 MLP down-projection input distance",
        before=(Member.PENDING, Member.PREFIX, Member.SUFFIX),
        loop=Member.WALKERS,
        reseed=(Member.CROSS,),
    ),
    Regime.MLP_NEAR: Plan(
        when="as `mlp`, the span at >= `suffix_near` of its rank limit, or the search met `mlp-graded` before",
        cost="as `mlp`",
        before=(Member.PENDING, Member.SUFFIX, Member.PREFIX),
        loop=Member.WALKERS,
        reseed=(Member.CROSS,),
    ),
    Regime.MLP_GRADED: Plan(
        when="layer 2 leaves < `mlp_codim` free; the MLP span usable but at its rank limit",
        cost="as `mlp`, graded",
        before=(Member.PENDING, Member.SUFFIX),
        loop=Member.TURNS,
        reseed=(Member.EXTEND, Member.CROSS),
    ),
}


def regime(objective: Objective, crowded: bool, near: bool) -> Regime:
    """A stage's regime: `crowded` (layer 2 without a usable MLP span), else its objective, an
    exact MLP one split by `near` (the span within `suffix_near` of its rank limit, or the search
    met the graded objective before: there the growth finds what the prefix seeds then cannot)."""
    if crowded:
        return Regime.CROWDED
    if objective == Objective.MLP:
        return Regime.MLP_NEAR if near else Regime.MLP
    return Regime.MLP_GRADED if objective == Objective.MLP_GRADED else Regime.LAYER2


def schedule_table() -> str:
    """`SCHEDULE` as the markdown table of docs/span.md (a test keeps the two the same)."""
    rows = [
        "| regime | when (stage start) | per position cost | before the loop, in order | loop | after a walker step |",
        "|---|---|---|---|---|---|",
    ]
    for r, p in SCHEDULE.items():
        loop = p.loop.value + (", work weighted by merit" if p.merit else "")
        reseed = ", else ".join(m.value for m in p.reseed) or "-"
        rows.append(
            f"| `{r.value}` | {p.when} | {p.cost} | {', '.join(m.value for m in p.before)} | {loop} | {reseed} |"
        )
    return "\n".join(rows)
