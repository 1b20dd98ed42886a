"""Configs: YAML + overrides, and one clear line for every bad key, type or name."""

from __future__ import annotations

from pathlib import Path

import pytest

from veil.config import from_dict, load_config
from veil.errors import VeilError


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def test_yaml_and_overrides(tmp_path: Path) -> None:
    p = write(tmp_path, "model: vit-digits\ndata: {name: digits}\ntrain: {epochs: 3}\n")
    cfg = load_config(p, ["train.lr=0.01", "batch_size=16", "model.dim=32"])
    assert cfg.train.epochs == 3 and cfg.train.lr == 0.01 and cfg.train.batch_size == 16
    assert cfg.model == {"name": "vit-digits", "dim": 32}
    assert cfg.defense == []


def test_int_is_accepted_for_float() -> None:
    assert from_dict({"train": {"lr": 1}}).train.lr == 1.0


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"modle": "vit-digits"}, "unknown config section 'modle'; allowed: model, data, defense, train"),
        ({"model": "vit-huge"}, "unknown model 'vit-huge'; choose one of"),
        (
            {"model": {"name": "vit-digits", "widht": 3}},
            "unknown config key 'model.widht' for model 'vit-digits'; allowed:",
        ),
        ({"data": "mnist"}, "unknown dataset 'mnist'; choose one of"),
        ({"data": {"name": "digits", "sizee": 3}}, "unknown config key 'data.sizee'"),
        ({"train": {"epochs": "ten"}}, "config key 'train.epochs' must be int, got 'ten'"),
        ({"train": {"epoch": 3}}, "unknown config key 'train.epoch'; allowed:"),
        ({"defense": "magic"}, "unknown defense 'magic'; choose one of"),
        ({"model": {"dim": 3}}, "config section 'model' must be a name or a mapping with a 'name' key"),
    ],
)
def test_bad_config_is_one_line(raw: dict, message: str) -> None:
    with pytest.raises(VeilError) as e:
        from_dict(raw)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_bad_files(tmp_path: Path) -> None:
    with pytest.raises(VeilError, match="config file '.*nope.yaml' does not exist"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(VeilError, match="is not valid YAML at line 2"):
        load_config(write(tmp_path, "model: a\n  - : [\n"))
    with pytest.raises(VeilError, match="must hold a mapping"):
        load_config(write(tmp_path, "- 1\n- 2\n"))


def test_bad_overrides() -> None:
    with pytest.raises(VeilError, match="override 'epochs' is not of the form key=value"):
        load_config(None, ["epochs"])
    with pytest.raises(VeilError, match="unknown config key 'colour' \\(no section accepts it\\)"):
        load_config(None, ["colour=red"])


def test_older_run_folder_config_still_matches(tmp_path) -> None:
    """A config saved before a key existed (here: label_smoothing) means the same run."""
    import yaml

    from veil.config import dump_config, load_config, same_config

    cfg = load_config(None, ["model=vit-digits"])
    raw = yaml.safe_load(dump_config(cfg))
    del raw["train"]["label_smoothing"]
    assert same_config(yaml.safe_dump(raw, sort_keys=False), cfg)
    assert not same_config(dump_config(load_config(None, ["model=vit-digits", "train.lr=0.5"])), cfg)
    assert not same_config("not: [valid", cfg)


def test_label_smoothing_changes_the_loss_and_is_checked() -> None:
    import torch

    from veil.build import build_run

    losses = []
    for ls in (0.0, 0.3):
        model, data, _ = build_run(
            load_config(None, ["model=vit-digits", "data=digits", f"train.label_smoothing={ls}"])
        )
        batch = {k: v[:8] for k, v in data.train.items()}
        losses.append(float(model.loss(model(batch), batch)))
        logits = model(batch)
        assert torch.isclose(
            model.loss(logits, batch), torch.nn.functional.cross_entropy(logits, batch["labels"], label_smoothing=ls)
        )
    assert losses[0] != losses[1]
    with pytest.raises(VeilError, match="label_smoothing"):
        load_config(None, ["train.label_smoothing=1.5"])


def test_a_section_that_is_not_a_mapping_is_one_line() -> None:
    """The train section goes through the shared section check (`veil.config.coerce_section`)."""
    with pytest.raises(VeilError, match=r"^config section 'train' must be a mapping$"):
        from_dict({"train": [1, 2]})
    with pytest.raises(VeilError, match=r"^config key 'train\.epochs' must be an integer >= 1, got 0$"):
        from_dict({"train": {"epochs": 0}})
