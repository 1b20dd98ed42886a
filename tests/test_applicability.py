"""Applicability is declared and checked: an attack outside the settings its equations model
(batch size, protocol, client dropout, tied embeddings, family) gives "not applicable: why", never a
number — in `veil attack`, in the audit's cells and in `Attack.reconstruct` itself."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from veil.attacks import Knowledge, create_attack
from veil.attacks.base import observe
from veil.cli import main
from veil.errors import VeilError
from veil.models import create_model

ROOT = Path(__file__).resolve().parent.parent
VIT = [
    str(ROOT / "configs" / "vit_digits.yaml"),
    "model.depth=1",
    "model.dim=16",
    "data.train_size=64",
    "data.test_size=20",
]
TEXT = [
    str(ROOT / "configs" / "minilm_sst2.yaml"),
    "model=bert-mini",
    "model.depth=2",
    "model.dropout=0.1",
    "data.max_len=16",
    "data.train_size=40",
    "data.test_size=20",
]


def run_cli(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, list[str]]:
    code = main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err.strip().splitlines()


def test_april_at_batch_4_is_not_applicable(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "a"
    argv = ["attack", *VIT, "--attack", "april", "--batch-size", "4", "--samples", "1", "--quiet", "--out", str(out)]
    code, lines = run_cli(capsys, argv)
    assert code == 2 and len(lines) == 1, lines
    assert "not applicable: april needs a private batch of at most 1" in lines[0], lines
    assert not (out / "summary.json").exists()  # no number written


def test_span_on_a_dropout_client_is_not_applicable_and_names_span_robust(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "a"
    argv = ["attack", *TEXT, "--attack", "span", "--batch-size", "2", "--samples", "1", "--quiet", "--out", str(out)]
    code, lines = run_cli(capsys, argv)
    assert code == 2 and len(lines) == 1, lines
    assert "not applicable: span" in lines[0] and "dropout 0.1" in lines[0] and "span-robust" in lines[0], lines
    assert not (out / "summary.json").exists()


def test_the_declarations_let_the_applicable_attackers_through() -> None:
    text = create_model("bert-mini", depth=2, dropout=0.1, vocab_size=30522, max_len=16)
    assert create_attack("span-robust").applies(text, 4, "single-step") is None
    assert create_attack("span-mjp").applies(text, 4) is not None  # the exact span test, as span
    clean = create_model("bert-mini", depth=2, dropout=0.0, vocab_size=30522, max_len=16)
    assert create_attack("span").applies(clean, 4, "single-step") is None
    vit = create_model("vit-digits", depth=1, dim=16)
    assert create_attack("april").applies(vit, 1, "fedsgd") is None
    assert "fedavg" in (create_attack("april").applies(vit, 1, "fedavg") or "")
    assert create_attack("april-mjp").applies(vit, 2) is not None  # inherits APRIL's batch 1
    assert "fedavg" in (create_attack("ig-fedavg").applies(vit, 1, "single-step") or "")


def test_reconstruct_refuses_a_batch_outside_the_declaration() -> None:
    torch.manual_seed(0)
    model = create_model("vit-digits", depth=1, dim=16)
    batch = {"pixels": torch.rand(2, 1, 8, 8), "labels": torch.tensor([1, 2])}
    with pytest.raises(VeilError, match="at most 1"):
        create_attack("april").reconstruct(observe(model, batch), Knowledge(batch_size=None))


def test_the_audit_skips_a_shared_attack_outside_its_batch() -> None:
    from veil.experiments.audit import validate
    from veil.experiments.scenario import parse_scenario

    raw = {
        "name": "b4",
        "attacks": ["april"],
        "tasks": [
            {
                "name": "digits",
                "run": {"model": {"name": "vit-digits", "depth": 1, "dim": 16}, "data": {"name": "digits"}},
                "defenses": ["none"],
                "attacks": ["labels"],
                "knowledge": {"batch_size": 4},
                "weights": "init",
            }
        ],
    }
    cells = validate(parse_scenario(raw))
    april = [c for c in cells if c.attack["name"] == "april"]
    assert april and all(c.skipped and "at most 1" in c.skipped for c in april)
    assert all(c.skipped is None for c in cells if c.attack["name"] == "labels")


def test_the_audit_routes_span_on_a_dropout_client_to_span_robust() -> None:
    from veil.experiments.audit import validate
    from veil.experiments.scenario import parse_scenario

    data = {"name": "sst2", "tokenizer": "wordpiece", "max_len": 16, "train_size": 40, "test_size": 20}
    raw = {
        "name": "dropout",
        "tasks": [
            {
                "name": "text",
                "run": {"model": {"name": "bert-mini", "depth": 2, "dropout": 0.1}, "data": data},
                "defenses": ["none"],
                "attacks": [{"name": "span", "budget": 1000}],  # span's options are not span-robust's
                "knowledge": {"batch_size": 2},
                "weights": "init",
            }
        ],
    }
    cells = {c.attack["name"]: c for c in validate(parse_scenario(raw))}
    assert set(cells) == {"span", "span-robust"}  # no longer an error: the attacker that applies runs
    assert "dropout 0.1" in (cells["span"].skipped or "") and "runs span-robust" in cells["span"].skipped
    assert cells["span-robust"].skipped is None and cells["span-robust"].attack == {"name": "span-robust"}
