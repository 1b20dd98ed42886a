"""The one registry rule (`veil.registry`): lazy module lists, strict loading, the public lookups;
and the core file layer's event log (`veil.io`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from veil.errors import VeilError
from veil.io import append_events, truncate_events
from veil.registry import ATTACKS, DATASETS, DEFENSES, MODELS, PROTOCOLS, Registry


def test_importing_the_core_imports_no_component_package() -> None:
    """veil.registry, veil.config and veil.build name components; they load only on a lookup."""
    probe = (
        "import sys, json, veil.build, veil.config, veil.registry; "
        "print(json.dumps(sorted(m for m in ('transformers', 'veil.models', 'veil.data', 'veil.defenses', "
        "'veil.attacks', 'veil.federated') if m in sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(out.stdout) == []


def test_importing_the_models_does_not_load_transformers() -> None:
    """The HF builders register from veil.models.hf, which the model registry imports on its first lookup."""
    probe = (
        "import sys, veil.models; a = 'transformers' in sys.modules; "
        "from veil.registry import MODELS; n = MODELS.names(); "
        "print(a, 'transformers' in sys.modules, 'minilm' in n)"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.split() == ["False", "True", "True"]


def test_every_registry_fills_from_its_modules() -> None:
    assert {"vit-digits", "minilm"} <= set(MODELS.names())
    assert {"digits", "sst2"} <= set(DATASETS.names())
    assert {"none", "mjp", "aegis", "dpsgd", "prune", "gaussian", "permutation"} <= set(DEFENSES.names())
    assert {"april", "ig", "span", "labels"} <= set(ATTACKS.names())
    assert PROTOCOLS.names() == ["dp-audit", "fedavg", "split"]


def test_public_lookups() -> None:
    opt = DEFENSES.options("mjp")["gamma"]
    assert opt.name == "gamma" and "gamma" in DEFENSES.keys("mjp")
    assert MODELS.keys("vit-digits") == set(MODELS.options("vit-digits"))
    assert DATASETS.factory("digits") is DATASETS.factory("digits")
    with pytest.raises(VeilError, match=r"^unknown defense 'mjpp'; choose one of: .*mjp"):
        DEFENSES.factory("mjpp")
    assert "mjpp" not in DEFENSES


def test_a_listed_module_that_does_not_import_is_an_error() -> None:
    """Never a silently shorter list (the old loaders skipped a missing module)."""
    reg: Registry[object] = Registry("widget", modules=("veil.no_such_module",))
    with pytest.raises(ModuleNotFoundError, match="veil.no_such_module"):
        reg.names()


def test_a_name_registers_once() -> None:
    reg: Registry[object] = Registry("widget")
    reg.register("a", "one")(object)
    with pytest.raises(ValueError, match="widget 'a' is registered twice"):
        reg.register("a")(object)
    assert reg.describe() == {"a": "one"}


def test_truncate_events_keeps_what_the_checkpoint_covers(tmp_path: Path) -> None:
    log = tmp_path / "metrics.jsonl"
    append_events(log, [{"event": "round", "round": r} for r in (1, 2, 3)] + [{"event": "note"}])
    truncate_events(log, "round", 2)
    assert [json.loads(line) for line in log.read_text().splitlines()] == [
        {"event": "round", "round": 1},
        {"event": "round", "round": 2},
        {"event": "note"},
    ]
    truncate_events(tmp_path / "missing.jsonl", "step", 0)  # nothing logged yet: nothing to cut
    assert not (tmp_path / "missing.jsonl").exists()


@pytest.mark.parametrize(
    "registry,name", [(r, n) for r in (MODELS, DATASETS, DEFENSES, ATTACKS) for n in r.names()], ids=str
)
def test_every_component_refuses_an_unknown_option_in_one_line(registry: Registry, name: str) -> None:
    """Every registered model, data set, defense and attack: a key it does not take is one VeilError
    line naming it (before anything is built), the nearest allowed key and all of them."""
    keys = sorted(registry.keys(name))
    typo = keys[0] + "x" if keys else "colour"
    with pytest.raises(VeilError) as e:
        registry.create(name, **{typo: 1})
    line = str(e.value)
    assert "\n" not in line and f"unknown option {typo!r}" in line and name in line
    assert all(k in line for k in keys)
    if keys:
        assert f"did you mean {keys[0]!r}" in line
