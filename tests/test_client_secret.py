"""A defense's client-held `secret`: the same secret replays the same draws, another secret (or the
seed alone) gives fresh ones — so whoever knows only the config cannot regenerate them."""

from __future__ import annotations

import pytest
import torch

from helpers import batch_for
from veil.defenses import create_defense
from veil.errors import VeilError
from veil.models import create_model
from veil.training.step import client_step

NOISY = [
    ("aegis", "transformer4", {"dim": 16, "depth": 1, "heads": 2}),
    ("dpsgd", "vit-digits", {"dim": 16, "depth": 1, "heads": 2}),
    ("gaussian", "vit-digits", {"dim": 16, "depth": 1, "heads": 2}),
    ("mjp", "vit-digits", {"dim": 16, "depth": 1, "heads": 2}),
]


def _grads(defense: str, model_name: str, kw: dict, secret: int | None) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = create_model(model_name, **kw)
    settings = {
        "seed": 5,
        **({"gamma": 0.5} if defense == "mjp" else {}),
        **({"noise_multiplier": 1.0} if defense == "dpsgd" else {}),
    }
    d = create_defense(defense, **settings).attach(model)
    d.secret = secret
    torch.manual_seed(1)
    b = batch_for(model, 4, 9)
    torch.manual_seed(2)
    return client_step(model, b, [d], None, step=3).grads


@pytest.mark.parametrize("defense,model_name,kw", NOISY)
def test_secret_replays_and_changes_a_defenses_draws(defense: str, model_name: str, kw: dict) -> None:
    a, again = _grads(defense, model_name, kw, 2**200 + 17), _grads(defense, model_name, kw, 2**200 + 17)
    other, seed_only = _grads(defense, model_name, kw, 2**200 + 18), _grads(defense, model_name, kw, None)
    assert all(torch.equal(a[k], again[k]) for k in a)
    for b in (other, seed_only):
        assert any(not torch.equal(a[k], b[k]) for k in a)


def test_permutation_keys_follow_the_secret() -> None:
    from veil.defenses.permutation import PatchPermutation

    h = torch.randn(3, 16, 8)
    keys = []
    for secret in (None, 2**130, 2**130, 2**130 + 1):
        p = PatchPermutation(True, seed=7)
        p.secret = secret
        state: dict = {}
        p.before_send(h, state)
        keys.append(state["keys"])
    assert torch.equal(keys[1], keys[2]) and not torch.equal(keys[0], keys[1]) and not torch.equal(keys[1], keys[3])


def test_bad_secret_mode_is_a_one_line_error(tmp_path) -> None:
    from veil.federated.fedavg.config import federated_config
    from veil.federated.split.spec import split_config

    with pytest.raises(VeilError, match="federated.secret must be one of random, seeded"):
        federated_config({"secret": "none"})
    with pytest.raises(VeilError, match="split.secret must be one of random, seeded"):
        split_config({"secret": "fixed"})
