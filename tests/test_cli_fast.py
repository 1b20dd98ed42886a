"""A fast `veil`: --help, --version and list import no torch; `veil list --details NAME` prints a
component's options from its builder's signature."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from veil.cli import main
from veil.commands import catalog

PROBE = """
import json, sys
from veil.cli import main
try:
    main({argv!r})
except SystemExit:
    pass
print(json.dumps(sorted(m for m in ("torch", "transformers", "numpy", "flwr", "veil.models", "veil.attacks") if m in sys.modules)), file=sys.stderr)
"""


def heavy_imports(argv: list[str], env: dict[str, str] | None = None) -> tuple[list[str], str]:
    res = subprocess.run(
        [sys.executable, "-c", PROBE.format(argv=argv)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )
    return json.loads(res.stderr.strip().splitlines()[-1]), res.stdout


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["train", "--help"], ["attack", "--help"]])
def test_help_and_version_import_no_torch(argv: list[str]) -> None:
    loaded, out = heavy_imports(argv)
    assert loaded == [], loaded
    assert out


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A user cache holding the catalog of the sources under test (as a first `veil list` leaves it)."""
    root = tmp_path_factory.mktemp("cache")
    catalog.write(catalog.build(), root / "veil" / "catalog.json")
    return root


def test_list_imports_no_torch_when_its_catalog_is_current(cache: Path) -> None:
    loaded, out = heavy_imports(["list"], {"XDG_CACHE_HOME": str(cache)})
    assert loaded == [], loaded
    for name in ("vit-digits", "hf-gpt2", "digits", "sst2", "mjp", "aegis", "april", "ig"):
        assert f"  {name} " in out


def test_catalog_options_are_the_builders(cache: Path) -> None:
    from veil.registry import DATASETS, DEFENSES, MODELS

    kinds = json.loads((cache / "veil" / "catalog.json").read_text())["kinds"]
    for kind, keys in (("models", MODELS.keys), ("data sets", DATASETS.keys), ("defenses", DEFENSES.keys)):
        for name, entry in kinds[kind].items():
            assert {row[0] for row in entry["options"]} == set(keys(name)), (kind, name)


def test_list_details(cache: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    assert main(["list", "--details", "mjp"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("defense mjp: ")
    assert any(
        line.split()[:4] == ["gamma", "float", "or", "none"] and "shuffle ratio" in line for line in out.splitlines()
    )
    assert main(["list", "--details", "vit-digits"]) == 0
    rows = {line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines()[2:]}
    assert rows["dim"][:2] == ["int", "64"] and rows["patch_size"][:2] == ["int", "2"]  # the preset's defaults
    assert " ".join(rows["dim"][2:]) == "width of the token vectors"  # every option has help
    assert main(["list", "--details", "nope"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["veil: error: unknown component 'nope'; `veil list` shows the names"]


def test_attack_command_references_are_the_harness() -> None:
    from veil.attacks.harness import REFERENCES
    from veil.commands.attack import REFERENCES as CLI_REFERENCES

    assert CLI_REFERENCES == REFERENCES
