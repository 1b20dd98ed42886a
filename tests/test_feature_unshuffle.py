"""Split learning: feature inversion un-shuffles through the frozen head by default wherever the
p-FeSTA permutation is on, and the feature audit leads with it (the naive decoder follows)."""

from __future__ import annotations

from pathlib import Path

import pytest

from veil.attacks import Knowledge, create_attack
from veil.errors import VeilError
from veil.federated.split.feature_audit import DEFAULT_ATTACKS, feature_attacks
from veil.federated.split.spec import load_split_spec

ON = {"permutation": {"name": "permutation", "enabled": True}}


def test_unshuffle_is_on_exactly_when_the_permutation_is_known_to_be_on() -> None:
    fi = create_attack("feature_inversion")
    assert fi.unshuffles(Knowledge(defense=ON))
    assert not fi.unshuffles(Knowledge())
    assert not fi.unshuffles(Knowledge(defense={"permutation": {"enabled": False}}))
    assert not create_attack("feature_inversion", unshuffle=False).unshuffles(Knowledge(defense=ON))
    assert create_attack("feature_inversion", unshuffle=True).unshuffles(Knowledge())
    with pytest.raises(
        VeilError, match="feature_inversion: option 'unshuffle' must be bool or one of 'auto', got 'yes'"
    ):
        create_attack("feature_inversion", unshuffle="yes").unshuffles(Knowledge())


def test_feature_audit_leads_with_the_unshuffled_inversion(tmp_path: Path) -> None:
    assert (
        next(iter(DEFAULT_ATTACKS)) == "feature_inversion+unshuffle"
        and DEFAULT_ATTACKS["feature_inversion+unshuffle"] == {}
    )
    p = tmp_path / "split.yaml"
    p.write_text(
        "model: {name: vit-digits}\ndata: {name: digits}\ntrain: {lr: 0.002, seed: 0}\nsplit: {protocol: pfesta}\n"
    )
    spec = load_split_spec(p, ["model.dim=16", "model.depth=1", "model.heads=2"])
    small = {"steps": 100, "hidden": 128, "lr": 3e-3}
    res = feature_attacks(spec, victims=32, attacks={"feature_inversion+unshuffle": small, "feature_inversion": small})
    adaptive, naive = res["feature_inversion+unshuffle"], res["feature_inversion"]
    # the head's affine structure puts every token back: the same decoder sees the same features
    assert adaptive["permuted"]["psnr"] == pytest.approx(adaptive["plain"]["psnr"], abs=1e-6)
    assert naive["plain"]["psnr"] == pytest.approx(adaptive["plain"]["psnr"], abs=1e-6)
    assert naive["psnr_drop_db"] > 3  # the naive decoder is what the permutation stops
    assert res["strongest"] == "feature_inversion+unshuffle"
