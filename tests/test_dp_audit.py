"""One-run privacy auditing (Steinke, Nasr, Jagielski 2023) and membership inference (issue 44):
the bound against hand-computed values, its soundness on a mechanism of known epsilon, the canary
audit of veil's DP-SGD (a correct mechanism passes, a broken one is flagged), the membership
metrics, and the dp-audit protocol through `veil audit` to the report."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from veil.attacks.membership import lira_offline
from veil.defenses.dpsgd import DPSGD
from veil.errors import VeilError
from veil.experiments.audit import run_audit
from veil.experiments.scenario import parse_scenario
from veil.metrics.dp_audit import audit, epsilon_lower_bound, flagged, max_epsilon, p_value
from veil.metrics.membership import auc, roc, summarize, tpr_at
from veil.report.render import write_reports


def _logit(q: float) -> float:
    return math.log(q / (1 - q))


def test_p_value_by_hand() -> None:
    # m 10, r 2, v 2, eps 0, delta 0.01: q = 1/2, beta = P[Bin(2, 1/2) >= 2] = 1/4,
    # alpha = max(pmf(1) / 1, (pmf(1) + pmf(0)) / 2) = max(1/2, 3/8) = 1/2; p = 1/4 + 1/2 * 0.01 * 2 * 10
    assert p_value(10, 2, 2, 0.0, 0.01) == pytest.approx(0.35, abs=1e-12)
    assert p_value(10, 4, 0, 1.0, 0.0) == 1.0  # no correct guess refutes nothing


def test_every_guess_right_gives_the_closed_form() -> None:
    # delta 0, r = v = 100: the p-value is q^100, so epsilon-hat = logit(0.05^(1/100)) = 3.4930
    assert epsilon_lower_bound(100, 100, 100, 0.0, 0.95) == pytest.approx(_logit(0.05 ** (1 / 100)), abs=1e-4)
    assert epsilon_lower_bound(100, 100, 100, 0.0, 0.95) == pytest.approx(3.49297, abs=1e-4)
    # delta > 0 only lowers it; half right refutes nothing
    assert epsilon_lower_bound(1000, 100, 100, 1e-5) < epsilon_lower_bound(1000, 100, 100, 0.0)
    assert epsilon_lower_bound(1000, 200, 100, 1e-5) == 0.0


def test_audit_random_scores_give_zero_and_perfect_scores_the_ceiling() -> None:
    rng = np.random.default_rng(0)
    inc = rng.random(1000) < 0.5
    assert audit(rng.normal(size=1000), inc, 1e-5)["eps_hat"] < 0.2
    perfect = audit(inc.astype(float), inc, 1e-5)
    assert 4.0 < perfect["eps_hat"] <= max_epsilon(1000, 1e-5) + 1e-9
    assert perfect["v"] == perfect["r"]
    with pytest.raises(VeilError, match="one score per canary"):
        audit(np.zeros(3), np.zeros(4, dtype=bool), 1e-5)


def test_bound_is_sound_on_randomized_response() -> None:
    """An eps-DP mechanism (randomized response on each canary's bit): epsilon-hat <= eps in at
    least 95 % of runs (here: every one of 40 but at most a few)."""
    eps, m = 1.0, 1000
    rng = np.random.default_rng(1)
    over = 0
    for _ in range(40):
        inc = rng.random(m) < 0.5
        keep = rng.random(m) < 1 / (1 + math.exp(-eps))
        scores = np.where(keep == inc, 1.0, -1.0) + 1e-3 * rng.normal(size=m)
        over += audit(scores, inc, 0.0, seed=int(rng.integers(1 << 30)))["eps_hat"] > eps
    assert over <= 4


def test_flagged() -> None:
    assert flagged(1.2, 1.0) and not flagged(0.8, 1.0)
    assert not flagged(5.0, None) and not flagged(5.0, "inf")


def test_membership_metrics_by_hand() -> None:
    fpr, tpr = roc(np.array([3.0, 2.0, 2.0, 0.0]), np.array([2.0, 1.0, 0.0, -1.0]))
    assert auc(fpr, tpr) == pytest.approx(0.78125)  # 12.5 of 16 pairs ordered right (ties count 1/2)
    assert tpr_at(fpr, tpr, 0.0) == 0.25 and tpr_at(fpr, tpr, 0.25) == 0.75
    s = summarize(np.arange(100.0) + 1000, np.arange(1000.0))
    assert s["tpr_at_0.001"] == 1.0 and s["auc"] == 1.0


def test_lira_offline_calibrates_per_example_difficulty() -> None:
    """Members get +1 in phi; examples' difficulty varies 10x more than that: the loss attack is
    near chance, LiRA with OUT references recovers the shift."""
    g = torch.Generator().manual_seed(0)
    n, k = 2000, 8
    difficulty = 10 * torch.randn(n, generator=g, dtype=torch.float64)
    member = torch.arange(n) < n // 2
    phi = difficulty + member.double() * 1.0 + 0.1 * torch.randn(n, generator=g, dtype=torch.float64)
    trained = torch.rand(k, n, generator=g) < 0.5
    ref = difficulty + trained.double() * 1.0 + 0.1 * torch.randn(k, n, generator=g, dtype=torch.float64)
    score = lira_offline(phi, ref, trained)
    assert summarize(score[member].numpy(), score[~member].numpy())["tpr_at_0.01"] > 0.9
    assert summarize(phi[member].numpy(), phi[~member].numpy())["tpr_at_0.01"] < 0.1
    with pytest.raises(VeilError, match="did not train"):
        lira_offline(phi, ref, torch.ones(k, n, dtype=torch.bool))


def _scenario(defenses: list, references: int = 0) -> dict:
    return {
        "name": "dp-audit-quick",
        "seeds": [0],
        "tasks": [
            {
                "name": "t4",
                "protocol": "dp-audit",
                "run": {
                    "model": {"name": "transformer4", "dim": 32, "depth": 1, "heads": 2},
                    "data": {
                        "name": "sst2",
                        "tokenizer": "wordpiece",
                        "max_len": 16,
                        "train_size": 600,
                        "test_size": 64,
                    },
                    "train": {"epochs": 2, "batch_size": 32, "lr": 0.003, "threads": 1},
                },
                "defenses": defenses,
                "canaries": {"gradient": 200, "input": 100, "references": references},
            }
        ],
    }


DP = {"name": "dpsgd", "noise_multiplier": 3.0, "delta": 1e-5}


def test_dp_sgd_audit_passes_and_report_shows_claim_beside_measurement(tmp_path) -> None:
    """End to end through `veil audit`: without DP the white-box canaries give epsilon-hat near the
    audit's ceiling (the audit has power); veil's DP-SGD stays at or below its accountant's epsilon;
    the report puts the two side by side and draws the membership ROC."""
    summary = run_audit(parse_scenario(_scenario(["none", DP], references=1)), tmp_path, progress=False)
    t = summary["tasks"]["t4"]
    none, dp = t["dp_audit"]["none"], t["dp_audit"]["dpsgd(delta=1e-05,noise_multiplier=3.0)"]
    assert none["claimed_epsilon"] is None and none["white_box"]["eps_hat"] > 2.0
    assert 0 < float(dp["claimed_epsilon"]) < 1.0 and dp["eps_hat"] <= float(dp["claimed_epsilon"])
    assert not dp["flagged"]
    assert set(t["membership"]["none"]) == {"loss", "lira"}
    write_reports(summary, tmp_path)
    report = (tmp_path / "report.md").read_text()
    assert "Privacy claim vs one-run audit" in report and "consistent with the claim" in report
    assert "Measured epsilon-hat (one-run audit" in report
    assert (tmp_path / "figures" / "t4_membership_roc.png").stat().st_size > 10_000


def test_audit_flags_dp_sgd_that_leaves_the_embedding_unnoised(tmp_path, monkeypatch) -> None:
    """Re-introduce a broken mechanism: noise on every parameter but the token-embedding table.
    The accountant still prints its epsilon (< 1); the white-box canaries there refute it."""
    real = DPSGD._noised

    def broken(self, total, gen):  # noqa: ANN001, ANN202
        return total if total.dim() == 2 and total.shape[0] > 1000 else real(self, total, gen)

    monkeypatch.setattr(DPSGD, "_noised", broken)
    t = run_audit(parse_scenario(_scenario([DP])), tmp_path, progress=False)["tasks"]["t4"]
    dp = t["dp_audit"]["dpsgd(delta=1e-05,noise_multiplier=3.0)"]
    assert dp["flagged"] and dp["eps_hat"] > 2 * float(dp["claimed_epsilon"])
    write_reports({**{"scenario": "x", "seeds": [0], "versions": {}, "config": {}}, "tasks": {"t4": t}}, tmp_path)
    assert "BUG in the mechanism" in (tmp_path / "report.md").read_text()


def test_bad_canary_options_fail_in_one_line(tmp_path) -> None:
    raw = _scenario(["none"])
    raw["tasks"][0]["canaries"] = {"gradients": 10}
    with pytest.raises(VeilError, match="unknown key 'canaries.gradients'"):
        run_audit(parse_scenario(raw), tmp_path, progress=False)
    raw["tasks"][0]["canaries"] = {"gradient": 0, "input": 0}
    with pytest.raises(VeilError, match="needs canaries"):
        run_audit(parse_scenario(raw), tmp_path, progress=False)


def test_head_class_sum_canaries_are_orthogonal_to_every_sample_gradient() -> None:
    """Where only a softmax head trains, canary j = sum over class rows of column j: each sample's
    gradient there is (p - y) h^T with sum_c (p_c - y_c) = 0, so the data add nothing to a score."""
    from veil.build import build_run
    from veil.config import from_dict
    from veil.experiments.canaries import gradient_canaries, head_columns

    cfg = {
        "model": {"name": "transformer4", "dim": 32, "depth": 1, "heads": 2, "dropout": 0.0},
        "data": {"name": "sst2", "tokenizer": "wordpiece", "max_len": 16, "train_size": 64, "test_size": 8},
    }
    model, data, _ = build_run(from_dict(cfg))
    for n, p in model.named_parameters():  # what dpsgd(trainable=^head) trains
        p.requires_grad_(n.startswith("head."))
    name, cols = head_columns(model)
    assert cols.shape == (32, 2)
    c = gradient_canaries(model, [data.train], 16, 1.0, torch.Generator().manual_seed(0))
    assert c.where == "the head's class-sum directions" and c.index.shape == (16, 2)
    logits = model(data.train)
    for i in range(4):  # per-sample gradients of the head's weight
        g = torch.autograd.grad(
            model.loss(logits[i : i + 1], {"labels": data.train["labels"][i : i + 1]}),
            model.head.weight,
            retain_graph=True,
        )[0]
        assert g.abs().max() > 1e-4 and g.view(-1)[c.index].sum(1).abs().max() < 1e-6


def test_head_recipe_on_frozen_features_is_audited(tmp_path) -> None:
    """The DP head recipe's path (train.frozen_features): without noise the head's canaries are all
    told apart; with noise epsilon-hat stays at or below the claim."""
    raw = _scenario(
        [
            {"name": "dpsgd", "noise_multiplier": 0.0, "clip": 1.0e6, "trainable": "^head"},
            {"name": "dpsgd", "noise_multiplier": 3.0, "delta": 1e-5, "trainable": "^head"},
        ]
    )
    task = raw["tasks"][0]
    task["run"]["model"]["dropout"] = 0.0
    task["run"]["train"].update(frozen_features=True, batch_size=64, lr=0.03, epochs=4)
    task["canaries"]["gradient"] = 32
    t = run_audit(parse_scenario(raw), tmp_path, progress=False)["tasks"]["t4"]
    free, dp = t["dp_audit"].values()
    assert free["white_box"]["coordinates"] == "the head's class-sum directions"
    assert free["white_box"]["v"] == free["white_box"]["r"] > 0 and free["eps_hat"] > 1.0
    assert dp["eps_hat"] <= float(dp["claimed_epsilon"]) and not dp["flagged"]


def test_flower_client_level_dp_audited_with_canary_clients() -> None:
    """Flower's DP-FedAvg wrapper as `veil federate` builds it, driven with canary clients: without
    noise (nearly) every guess is right; at the accountant's noise for epsilon 2 epsilon-hat stays below it."""
    import logging

    from veil.federated.fedavg.dp_audit import canary_clients

    logging.disable(logging.INFO)
    try:
        free = canary_clients(noise=0.0, rounds=20, canaries=200, clients=50, fraction=0.2)
        dp = canary_clients(target_epsilon=2.0, rounds=20, canaries=200, clients=50, fraction=0.2)
    finally:
        logging.disable(logging.NOTSET)
    # an included canary that no round sampled scores 0, as the excluded ones do: at most a guess or two wrong
    assert free["claimed_epsilon"] == "inf" and free["v"] >= free["r"] - 2 and free["eps_hat"] > 2.5
    assert dp["claimed_epsilon"] == pytest.approx(2.0, rel=0.05) and dp["eps_hat"] <= 2.0 and not dp["flagged"]
    with pytest.raises(VeilError, match="canary-client audit supports"):
        canary_clients(kind="local")


def test_single_step_audit_reports_membership_when_asked(tmp_path) -> None:
    """`evaluate: {membership: true}` on a single-step task: the loss attack's numbers per defense
    in the summary and a table in the report; a bad value is one line."""
    raw = {
        "name": "mia",
        "seeds": [0],
        "tasks": [
            {
                "name": "digits",
                "run": {
                    "model": {"name": "vit-digits"},
                    "data": {"name": "digits"},
                    "train": {"epochs": 2, "threads": 1},
                },
                "defenses": ["none"],
                "evaluate": {"membership": True},
            }
        ],
    }
    summary = run_audit(parse_scenario(raw), tmp_path, progress=False)
    m = summary["tasks"]["digits"]["utility"]["none"]["evaluations"]["membership"]
    assert m["members"] == 1438 and m["nonmembers"] == 359 and 0.0 <= m["tpr_at_0.01"] <= 1.0 and 0.3 < m["auc"] < 1.0
    write_reports(summary, tmp_path)
    assert "Membership inference (loss attack): training split vs test split" in (tmp_path / "report.md").read_text()
    raw["tasks"][0]["evaluate"] = {"membership": "yes"}
    with pytest.raises(VeilError, match="evaluate.membership must be true or false"):
        parse_scenario(raw)


def test_canaries_outside_a_dp_audit_task_fail_in_one_line() -> None:
    raw = _scenario(["none"])
    raw["tasks"][0]["protocol"] = "single-step"
    with pytest.raises(VeilError, match="canaries applies to protocol: dp-audit tasks only"):
        parse_scenario(raw)
