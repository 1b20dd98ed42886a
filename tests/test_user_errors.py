"""Errors in the user's terms: each bad input a new user met is one line, exit 2, no traceback,
naming the problem and the way on; relative paths in a config resolve against its folder; `--out`
never writes among a user's own files; the word tokenizer keeps Unicode words; progress bars only
on a terminal; `veil list --details` reads as prose."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from veil.cli import main

ROOT = Path(__file__).resolve().parent.parent
VIT = str(ROOT / "configs" / "vit_digits.yaml")
TINY = ["model.depth=1", "model.dim=16", "data.train_size=64", "data.test_size=20", "--quiet"]


def run_cli(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, list[str]]:
    code = main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err.strip().splitlines()


def one_line(code: int, lines: list[str], *words: str) -> None:
    assert code == 2, lines
    assert len(lines) == 1 and lines[0].startswith("veil: error: "), lines
    for w in words:
        assert w in lines[0], lines


def test_a_config_that_is_not_utf8_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_bytes("model: vit-digits\n# caf\u00e9\n".encode("latin-1"))
    code, lines = run_cli(capsys, ["train", str(cfg), "--out", str(tmp_path / "r")])
    one_line(code, lines, "not UTF-8", str(cfg))


def test_a_scenario_that_is_not_utf8_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    s = tmp_path / "s.yaml"
    s.write_bytes(b"name: caf\xe9\ntasks: []\n")
    code, lines = run_cli(capsys, ["audit", str(s), "--out", str(tmp_path / "a")])
    one_line(code, lines, "not UTF-8", "scenario")


def test_an_empty_config_is_refused_saying_what_a_config_needs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "empty.yaml"
    cfg.write_text("# nothing yet\n")
    out = tmp_path / "r"
    code, lines = run_cli(capsys, ["train", str(cfg), "--out", str(out)])
    one_line(code, lines, "is empty", "model", "data")
    assert not out.exists()


@pytest.mark.parametrize("body", ["[a, b]\n", "42\n", "just words\n"])
def test_a_scenario_that_is_a_list_or_scalar_says_scenario(
    body: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    s = tmp_path / "s.yaml"
    s.write_text(body)
    code, lines = run_cli(capsys, ["audit", str(s), "--out", str(tmp_path / "a")])
    one_line(code, lines, "scenario", "mapping", "tasks")
    assert "sections" not in lines[0], lines


def test_out_in_a_folder_that_cannot_be_written_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import veil.runlock

    real = os.open

    def denied(path: str | os.PathLike, *a: object, **k: object) -> int:
        if str(path).endswith(veil.runlock.LOCK_NAME):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real(path, *a, **k)  # type: ignore[arg-type]

    out = tmp_path / "ro"
    out.mkdir()
    monkeypatch.setattr(veil.runlock.os, "open", denied)
    code, lines = run_cli(capsys, ["train", VIT, *TINY, "--out", str(out)])
    one_line(code, lines, "cannot write", str(out))


def test_out_refuses_a_folder_with_the_users_own_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "mine"
    out.mkdir()
    (out / "thesis.tex").write_text("precious")
    code, lines = run_cli(capsys, ["train", VIT, *TINY, "train.max_steps=1", "--out", str(out)])
    one_line(code, lines, "not a veil run folder", "thesis.tex")
    assert sorted(p.name for p in out.iterdir()) == ["thesis.tex"]  # nothing written among them


def test_relative_data_path_resolves_against_the_config_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from veil.config import load_config

    conf = tmp_path / "project"
    conf.mkdir()
    (conf / "reviews.csv").write_text("text,label\n" + "".join(f"good film {i},1\nbad film {i},0\n" for i in range(8)))
    raw = {"model": "transformer4", "data": {"name": "table", "path": "reviews.csv", "tokenizer": "word"}}
    (conf / "c.yaml").write_text(yaml.safe_dump(raw))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    cfg = load_config(conf / "c.yaml")
    assert cfg.data["path"] == str(conf / "reviews.csv")
    raw["data"]["path"] = "missing.csv"
    (conf / "c.yaml").write_text(yaml.safe_dump(raw))
    code, lines = run_cli(capsys, ["train", str(conf / "c.yaml"), "--out", str(tmp_path / "r")])
    one_line(code, lines, str(conf / "missing.csv"), "does not exist")


def test_a_tsv_named_csv_gets_a_hint(tmp_path: Path) -> None:
    from veil.data.files import column, read_table
    from veil.errors import VeilError

    f = tmp_path / "data.csv"
    f.write_text("text\tlabel\ngood\t1\nbad\t0\n")
    with pytest.raises(VeilError, match=r"tab-separated.*\.tsv"):
        column(read_table(f), "text", "text", f)


def test_the_word_tokenizer_keeps_unicode_words() -> None:
    from veil.data.tokenizers import split_words

    assert split_words("Café crème, naïve Zoë!") == ["café", "crème", ",", "naïve", "zoë", "!"]
    assert split_words("don't stop") == ["don't", "stop"]


def test_no_progress_bars_when_stderr_is_not_a_terminal(tmp_path: Path) -> None:
    out = tmp_path / "r"
    args = [VIT, "model.depth=1", "model.dim=16", "data.train_size=64", "data.test_size=20", "train.epochs=2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run(
        [sys.executable, "-m", "veil.cli", "train", *args, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert res.returncode == 0, res.stderr
    assert "\r" not in res.stderr and "it/s" not in res.stderr and "step/s" not in res.stderr, res.stderr[:500]
    assert "train" in res.stderr  # a line per stage instead
    assert len(res.stderr.splitlines()) <= 5, res.stderr


def test_list_details_reads_as_prose(capsys: pytest.CaptureFixture[str]) -> None:
    from veil.commands.catalog import load

    for name in ("sst2", "table", "image_folder", "mjp", "vit-digits", "aegis", "dpsgd"):
        assert main(["list", "--details", name]) == 0
        assert "<class" not in capsys.readouterr().out
    missing = [
        f"{kind} {name}: {row[0]}"
        for kind, entries in load()["kinds"].items()
        for name, entry in entries.items()
        for row in entry["options"] or []
        if not row[3].strip()
    ]
    assert missing == []


def test_attack_help_and_readme_agree_on_threads(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["attack", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert "one per core" not in help_text
    assert "the cores the machine can give" in help_text and "the cores the machine can give" in readme


PROBE = "import sys; from veil.cli import main; rc = main(sys.argv[1:]); print('TORCH', 'torch' in sys.modules); sys.exit(rc)"


@pytest.mark.parametrize(
    "argv",
    [
        ["train", "/nonexistent.yaml", "--out", "{tmp}/a"],
        ["train", VIT, "train.nosuch=1", "--out", "{tmp}/b"],
        ["eval", "/nonexistent"],
        ["attack", "/nonexistent", "--attack", "april", "--out", "{tmp}/c"],
        ["federate", "/nonexistent.yaml", "--out", "{tmp}/d"],
        ["split", "/nonexistent.yaml", "--out", "{tmp}/e"],
        ["audit", "/nonexistent.yaml", "--out", "{tmp}/f"],
        ["audit", VIT, "--out", "{tmp}/g"],  # a run config where a scenario belongs
        ["export", "/nonexistent", "--hf", "{tmp}/h"],
    ],
)
def test_a_bad_input_is_refused_before_torch_loads(tmp_path: Path, argv: list[str]) -> None:
    """Rejecting a typo must not cost the seconds torch takes to import: counted as whether torch
    was imported at all, not in seconds."""
    args = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    res = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, timeout=120)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and lines[0].startswith("veil: error: "), res.stderr
    assert "TORCH False" in res.stdout, (args, res.stdout)
    assert not any(tmp_path.iterdir())  # nothing half-written


def test_an_interrupt_on_a_terminal_starts_its_own_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A progress bar leaves the cursor at the end of its line: the interrupt's message must not
    be glued to it. Off a terminal there is no bar and no blank line."""
    import veil.commands.list as listing

    def interrupted(args: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(listing, "run", interrupted)
    for tty, first in ((True, ""), (False, "veil: interrupted")):
        monkeypatch.setattr(sys.stderr, "isatty", lambda tty=tty: tty)
        assert main(["list"]) == 130
        err = capsys.readouterr().err
        assert err.startswith("\n" if tty else "veil:"), repr(err)
        assert err.strip().splitlines()[0].startswith(first or "veil: interrupted")
