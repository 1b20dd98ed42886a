"""Every registered attack declares its budget in counted work (`Attack.budget`: unit -> amount,
`{}` for a closed-form attack) and reports the work it did in the same units; run once on a tiny
real model with a tiny budget, none does more than its budget, and the budget is said to have
stopped it when it ran out. An attack that declares no budget fails here."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from veil.attacks import Knowledge, LocalTraining, Observation, create_attack, list_attacks, observe
from veil.attacks.base import Reconstruction
from veil.attacks.harness import mean_metrics, score
from veil.data import load_data
from veil.models import create_model
from veil.models.vit import patchify

#: each budgeted attack with a tiny budget, and the scene it runs in
TINY: dict[str, tuple[str, dict[str, Any]]] = {
    "ig": ("image", {"iterations": 3, "restarts": 2}),
    "dlg": ("image", {"iterations": 3}),
    "april-mjp": ("image", {"iterations": 3, "restarts": 2}),
    "multi-round": ("image", {"attack": "ig", "iterations": 3, "restarts": 1}),
    "multi-round-global": ("image", {"attack": "ig", "iterations": 2, "restarts": 2}),
    "ig-fedavg": ("delta", {"iterations": 3, "restarts": 2}),
    "feature_inversion": ("features", {"steps": 3, "hidden": 16, "batch": 8}),
    "fsha": ("features", {"steps": 3, "hidden": 16, "batch": 8}),
    "tag": ("text", {"iterations": 3}),
    "lamp": ("text", {"iterations": 4, "discrete_every": 2, "candidates": 2}),
    "span": ("text", {"budget": 60}),
    "span-mjp": ("text", {"budget": 60, "corpus": "none"}),
    "span-down": ("text", {"budget": 60}),
}
#: attacks whose input fixes their work; those run here must report no work
CLOSED = {
    "april",
    "labels",
    "presence",
    "presence-adaptive",
    "presence-average",
    "head-embedding",
    "span-unfrozen",
    "span-robust",
    "sparse-rows",
}
RUN_CLOSED = {"april": "image", "labels": "image", "head-embedding": "image", "presence": "text"}
#: may stop before the budget on their own test (L-BFGS tolerances, LM at the rounding floor, an exact sentence)
EARLY = {"span", "span-mjp", "span-down", "dlg", "april-mjp"}


@pytest.fixture(scope="module")
def scenes() -> dict[str, tuple[Observation, Knowledge]]:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    digits = load_data("digits", train_size=40, test_size=20)
    vit = create_model("vit-digits", dim=32, depth=1, heads=2)
    img = {k: v[:1] for k, v in digits.test.items()}
    obs_img = observe(vit, img)
    know_img = Knowledge(batch_size=1, input_shape=(1, 8, 8), aux_data={"candidates": digits.test})
    local = LocalTraining(lr=0.01, steps=1, batch_size=1, epochs=1, samples=1)
    obs_delta = Observation(vit, obs_img.grads, kind="delta", local=local)

    sst2 = load_data("sst2", max_len=12, train_size=40, seed=0)
    enc = create_model("transformer4", max_len=12, dim=32, depth=2, heads=2)
    enc.eval()
    txt = {k: v[:1] for k, v in sst2.train.items()}
    obs_txt = observe(enc, txt)
    know_txt = Knowledge(batch_size=1, seq_len=12, tokenizer=sst2.meta["tokenizer"])

    lin, pos = torch.nn.Linear(4, 8), torch.randn(16, 8) * 0.02
    head = lambda x: lin(patchify(x, 2)) + pos  # noqa: E731 - a patch embedder as the client's head
    with torch.no_grad():
        feats = head(digits.test["pixels"][:2])
    obs_feat = Observation(model=None, features=feats, kind="features")  # type: ignore[arg-type]
    know_feat = Knowledge(aux_data={"pixels": digits.train["pixels"], "head": head}, seed=0)
    return {
        "image": (obs_img, know_img),
        "delta": (obs_delta, Knowledge(batch_size=1, input_shape=(1, 8, 8))),
        "text": (obs_txt, know_txt),
        "features": (obs_feat, know_feat),
    }


def test_every_registered_attack_declares_a_budget() -> None:
    """Each attack is here, as budgeted or closed form, and declares a budget (None: undeclared)."""
    names = set(list_attacks())
    assert names == set(TINY) | CLOSED, f"attacks without a budget test: {sorted(names - set(TINY) - CLOSED)}"
    for name in names:
        budget = create_attack(name).budget()
        assert budget is not None, f"{name} declares no budget"
        assert (budget == {}) == (name in CLOSED), f"{name}: {budget}"
        assert all(isinstance(v, int) and v >= 0 for v in budget.values()), f"{name}: {budget}"


def _check(name: str, rec: Reconstruction, budget: dict[str, int]) -> None:
    st = rec.stats
    assert st["budget"] == budget and set(st["work"]) <= set(budget), f"{name}: {st['work']} vs {budget}"
    assert all(st["work"].get(u, 0) > 0 for u in budget), f"{name} reported no work: {st['work']}"
    assert st["budget_used"] <= 1.0, f"{name}: work {st['work']} over its budget {budget}"
    if st["budget_used"] >= 1.0:
        assert st["budget_stopped"] is True, f"{name} spent its budget {budget} but says it was not stopped"


@pytest.mark.parametrize("name", sorted(TINY))
def test_budgeted_attack_stays_within_a_tiny_budget(scenes: dict, name: str) -> None:
    scene, settings = TINY[name]
    obs, know = scenes[scene]
    attack = create_attack(name, **settings)
    budget = attack.budget()
    rec = attack.reconstruct(obs, know)
    _check(name, rec, budget)
    if name not in EARLY:  # the others run their loops out
        assert rec.stats["budget_used"] == 1.0 and rec.stats["budget_stopped"] is True, rec.stats["work"]


@pytest.mark.parametrize("name", sorted(RUN_CLOSED))
def test_closed_form_attack_reports_no_work(scenes: dict, name: str) -> None:
    obs, know = scenes[RUN_CLOSED[name]]
    rec = create_attack(name).reconstruct(obs, know)
    assert rec.stats["budget"] == {} and rec.stats["work"] == {}
    assert rec.stats["budget_used"] == 0.0 and rec.stats["budget_stopped"] is False


def test_the_cell_metrics_carry_the_budget(scenes: dict) -> None:
    """score() puts budget_used / budget_stopped in a sample's metrics; a cell's roll-up keeps the
    mean and the largest budget_used, and budget_stopped if any sample was stopped."""
    obs, know = scenes["image"]
    rec = create_attack("ig", iterations=2, restarts=1).reconstruct(obs, know)
    ref = {"pixels": torch.rand(1, 1, 8, 8), "labels": torch.zeros(1, dtype=torch.long)}
    row = score(rec, ref, None)
    assert row["budget_used"] == 1.0 and row["budget_stopped"] == 1.0
    cell = mean_metrics([row, {**row, "budget_used": 0.5, "budget_stopped": 0.0}])
    assert cell["budget_used"] == 0.75 and cell["budget_used_max"] == 1.0 and cell["budget_stopped"] == 1.0
    closed = score(create_attack("april").reconstruct(obs, know), ref, None)
    assert "budget_used" not in closed  # fixed by the input: nothing to account


def test_over_budget_names_the_cells_past_the_margin() -> None:
    """The audit summary's check: a cell is over budget when a sample spent more than 1.2x."""
    from veil.experiments.summary import budget_table, over_budget

    row = {"budget_used": 1.0, "budget_used_max": 1.0, "budget_stopped": 1.0}
    summary = {"tasks": {"t": {"budget": {"none": {"ig": row, "span": {**row, "budget_used_max": 1.25}}}}}}
    assert over_budget(summary) == ["t / none / span: budget_used 1.250"]
    assert over_budget({"tasks": {"t": {"budget": {"none": {"ig": row}}}}}) == []
    table = budget_table(summary)
    assert "| t | none | ig | 1.000 | 1.000 | yes |" in table and table.endswith("t / none / span: budget_used 1.250")


def test_ig_and_tag_show_progress_over_their_work_only_when_asked(scenes: dict, capsys: pytest.CaptureFixture) -> None:
    """A bar over the counted work inside one update (`attack_progress`: a terminal run); none by
    default (library calls, the audit's workers, --quiet)."""
    from veil.attacks.base import attack_progress

    for name, scene in (("ig", "image"), ("tag", "text")):
        obs, know = scenes[scene]
        create_attack(name, iterations=2, **({"restarts": 1} if name == "ig" else {})).reconstruct(obs, know)
        assert capsys.readouterr().err == ""
        with attack_progress(True):
            create_attack(name, iterations=2, **({"restarts": 1} if name == "ig" else {})).reconstruct(obs, know)
        err = capsys.readouterr().err
        assert f"{name}:" in err and "/2" in err, err  # the bar: the attack, its units done of 2
