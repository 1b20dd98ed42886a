"""The census of what the server sees (`veil.attacks.census`) and the rule it enforces: every
exported tensor that some registered attack could read in the clear is read by an attack of the
default audit (the embedded quickstart's attacks for that modality)."""

from __future__ import annotations

from importlib.resources import files

import pytest
import torch
import yaml

from helpers import SMALL, batch_for
from veil.attacks import create_attack, list_attacks
from veil.attacks.census import census, clean_unread
from veil.defenses import create_defense, list_defenses
from veil.errors import VeilError
from veil.models import create_model

#: one small instance per model family (encoder, decoders with and without a position table, HF
#: adapters, a ViT)
FAMILIES = (
    "transformer4",
    "hf-bert",
    "vit-digits",
    *(pytest.param(f, marks=pytest.mark.slow) for f in ("gpt-tiny", "llama-tiny", "hf-gpt2")),
)
#: the registered defenses at their defaults, and AEGIS as published (no down-projection / head noise)
RECIPES = [{"name": d} for d in list_defenses() if d != "none"] + [
    {"name": "none"},
    {"name": "aegis", "mlp_down_noise": 0.0, "head_noise": 0.0},
]


def _default_audit(modality: str) -> list[str]:
    """The attacks the embedded quickstart runs on a task of `modality`."""
    cfg = yaml.safe_load(files("veil.configs").joinpath("quickstart.yaml").read_text())
    names = [a if isinstance(a, str) else a["name"] for a in cfg.get("attacks", [])]
    for t in cfg["tasks"]:
        model = create_model(t["run"]["model"] if isinstance(t["run"]["model"], str) else t["run"]["model"]["name"])
        if model.modality == modality:
            names += [a if isinstance(a, str) else a["name"] for a in t["attacks"]]
    return sorted(set(names))


def _model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = create_model(name, **SMALL.get(name, {}))
    model.eval()
    return model


@pytest.mark.parametrize("family", FAMILIES)
def test_every_clean_tensor_an_attack_could_read_is_read_by_the_default_audit(family: str) -> None:
    model = _model(family)
    registered = {a: create_attack(a) for a in list_attacks()}
    readable = {p for a in registered.values() if a.applies_to(model) is None for p in a.reads(model)}
    default = {a: registered[a] for a in _default_audit(model.modality)}
    checked = 0
    for recipe in RECIPES:
        kw = {k: v for k, v in recipe.items() if k != "name"}
        try:
            defenses = [] if recipe["name"] == "none" else [create_defense(recipe["name"], **kw).attach(model)]
        except VeilError:  # the defense does not apply to this model (modality, protocol)
            continue
        try:
            entries = census(model, batch_for(model), defenses, default)
        except VeilError:  # e.g. DP-SGD's schedule, split learning's permutation: no single-step update
            continue
        finally:
            for d in defenses:
                d.detach()
        assert not clean_unread(entries, readable), (recipe, clean_unread(entries, readable))
        checked += 1
    assert checked >= 2  # at least none and one defense


def test_census_of_aegis_published_and_default_on_an_encoder() -> None:
    model = _model("transformer4")
    attacks = {a: create_attack(a) for a in ("span-down", "span", "head-embedding")}
    published = create_defense("aegis", mlp_down_noise=0.0).attach(model)
    got = census(model, batch_for(model), [published], attacks)
    published.detach()
    assert got["blocks.0.attn.q.weight"]["state"] == "frozen"
    assert got["tok.weight"]["state"] == "noised" and got["tok.weight"]["nsr"] > 1
    assert got["blocks.0.mlp.fc1.weight"]["state"] == "noised"
    assert got["blocks.0.mlp.fc2.weight"]["state"] == "clean"
    assert "span-down" in got["blocks.0.mlp.fc2.weight"]["read_by"]
    assert got["blocks.3.mlp.fc2.weight"]["read_by"] == ["span-down"]  # the last block's: span-down alone
    assert got["head.weight"]["read_by"] == ["head-embedding"]
    default = create_defense("aegis").attach(model)
    got = census(model, batch_for(model), [default], attacks)
    default.detach()
    assert got["blocks.0.mlp.fc2.weight"]["state"] == "noised" and got["blocks.0.mlp.fc2.weight"]["nsr"] > 0.5
    none = census(model, batch_for(model), [], attacks)
    assert all(e["state"] == "clean" for e in none.values())
