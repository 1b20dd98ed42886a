"""`model: {name: hf, path: DIR}` on checkpoint folders written by save_pretrained (tests/hf_folders.py):
each family's adapter computes what the HF model computes, the attacks run on it through `veil
attack` with no user Python, bad folders are one line, and `veil export --hf` round-trips."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hf_folders import write_family, write_from_minilm
from veil.cli import main
from veil.errors import VeilError
from veil.models import create_model

FAMILIES = ["bert", "roberta", "distilbert", "gpt2", "llama", "mistral", "qwen2", "vit", "deit"]
TINY = dict(dim=32, depth=2, heads=2)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {k: write_family(k, root / k, **TINY) for k in FAMILIES}


def _text_batch(folder: Path) -> dict[str, torch.Tensor]:
    from veil.data.tokenizers import make_tokenizer

    ids, mask = make_tokenizer(str(folder)).encode(["a gripping, funny film.", "bad", "the plot is thin"], 12)
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([0, 1, 0])}


def _hf_logits(model, batch):  # noqa: ANN001, ANN202
    with torch.no_grad(), model.hf_layout() if hasattr(model, "hf_layout") else torch.enable_grad():
        if "pixels" in batch:
            return model.hf(pixel_values=batch["pixels"]).logits
        return model.hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits


@pytest.mark.parametrize("kind", FAMILIES)
def test_adapter_computes_what_the_hf_model_computes(folders, kind):
    """The adapter runs the embedding step itself (so a defense can act there): its logits are the
    HF model's own, RoBERTa's shifted position table and DeiT's two leading tokens included."""
    image = kind in ("vit", "deit")
    model = create_model("hf", path=str(folders[kind]), num_classes=10 if image else 2, dropout=0.0)
    model.eval()
    batch = {"pixels": torch.rand(2, 1, 8, 8)} if image else _text_batch(folders[kind])
    with torch.no_grad():
        mine = model(batch)
    ref = _hf_logits(model, batch)
    if model.task == "lm":  # the real positions (padding rows differ by design: masked everywhere)
        m = batch["attention_mask"].bool()
        mine, ref = mine[m], ref[m]
    assert torch.allclose(mine, ref, atol=1e-5), (mine - ref).abs().max()


def test_roberta_slot_t_reads_hf_row_t_plus_offset(folders):
    """RoBERTa positions start at padding_idx + 1: the handle's row t is HF's row t + 2, so attacks
    that read the table per slot line up; hf_layout gives HF's layout back unchanged."""
    from safetensors.torch import load_file

    model = create_model("hf", path=str(folders["roberta"]), num_classes=2)
    saved = load_file(str(folders["roberta"] / "model.safetensors"))["roberta.embeddings.position_embeddings.weight"]
    assert model.pos_offset == 2
    assert torch.equal(model.position_table()[:5], saved[2:7])
    assert model.max_positions() == saved.shape[0] - 2
    with model.hf_layout():
        assert torch.equal(model.position_table(), saved)
    assert torch.equal(model.position_table()[0], saved[2])


def test_minilm_folder_through_hf_is_the_minilm_preset():
    from veil.assets import minilm_dir
    from veil.data import load_data

    data = load_data("sst2", max_len=32, train_size=16, test_size=8)
    batch = {k: v[:8] for k, v in data.test.items()}
    torch.manual_seed(0)
    preset = create_model("minilm", num_classes=2, dropout=0.1, pooling="mean")
    torch.manual_seed(0)
    hf = create_model("hf", path=str(minilm_dir()), num_classes=2, dropout=0.1, pooling="mean")
    preset.eval()
    hf.eval()
    with torch.no_grad():
        assert (preset(batch) - hf(batch)).abs().max() < 1e-6
    assert preset.state_dict().keys() == hf.state_dict().keys()


def test_llama_handles_list_gate_and_up_and_aegis_noises_both(folders):
    """HF LLaMA has gate_proj and up_proj per block: both are listed, and AEGIS's channel 3 noises
    both (the clean gradient of each differs from what the client exports)."""
    from veil.defenses import create_defense

    model = create_model("hf", path=str(folders["llama"]), dropout=0.0)
    groups = model.mlp_up_groups()
    assert [len(g) for g in groups] == [2, 2]
    assert groups[0][1] is model.hf.model.layers[0].mlp.up_proj
    batch = _text_batch(folders["llama"])
    model.zero_grad()
    model.loss(model(batch), batch).backward()
    clean = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    aegis = create_defense("aegis", mlp_noise=1.0, embed_noise=0.0, head_noise=0.0, mlp_down_noise=0.0)
    aegis.attach(model)
    noised = {id(p) for p in aegis.noised_parameters(model)}
    for blk in model.hf.model.layers:
        assert id(blk.mlp.gate_proj.weight) in noised and id(blk.mlp.up_proj.weight) in noised
    model.zero_grad()
    model.loss(model(batch), batch).backward()
    aegis.transform_grads(model, step=0)
    for i in range(2):
        for part in ("gate_proj", "up_proj"):
            name = f"hf.model.layers.{i}.mlp.{part}.weight"
            p = dict(model.named_parameters())[name]
            assert not torch.allclose(p.grad, clean[name]), name


def test_dropout_override_and_fresh_head_said(folders, capsys):
    model = create_model("hf", path=str(folders["bert"]), num_classes=5, dropout=0.0)
    cfg = model.hf.config
    assert cfg.hidden_dropout_prob == cfg.attention_probs_dropout_prob == cfg.classifier_dropout == 0.0
    assert model.classifier().out_features == 5
    assert "fresh 5-class head" in capsys.readouterr().err
    stock = create_model("hf", path=str(folders["bert"]), num_classes=2)
    assert stock.hf.config.hidden_dropout_prob == 0.1  # the checkpoint's own


def test_hf_entry_lists_its_families():
    from veil.registry import MODELS

    help_line = MODELS.describe()["hf"]
    assert all(k in help_line for k in FAMILIES)


# ----------------------------------------------------------------------------- one-line refusals
def _one_line(fn) -> str:  # noqa: ANN001
    with pytest.raises(VeilError) as e:
        fn()
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_bad_folders_are_one_line(tmp_path, folders):
    assert "is not a folder" in _one_line(lambda: create_model("hf", path=str(tmp_path / "nope")))
    assert "no config.json" in _one_line(lambda: create_model("hf", path=str(tmp_path)))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "t5"}))
    msg = _one_line(lambda: create_model("hf", path=str(tmp_path)))
    assert "'t5' is not supported" in msg and "roberta" in msg and "qwen2" in msg
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
    assert "pytorch_model.bin" in _one_line(lambda: create_model("hf", path=str(tmp_path)))


def test_cli_vocabulary_mismatch_names_both(tmp_path, folders, capsys):
    """WordPiece ids into a BPE GPT-2 are refused in one line naming both tokenizers; without
    data.tokenizer the data uses the folder's own."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        f"model: {{name: hf, path: {folders['gpt2']}}}\n"
        "data: {name: sst2, tokenizer: wordpiece, max_len: 12, train_size: 8, test_size: 4}\n"
    )
    rc = main(["attack", str(cfg), "--attack", "labels", "--samples", "1", "--out", str(tmp_path / "o"), "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert "different vocabularies" in err[0] and "wordpiece" in err[0] and str(folders["gpt2"]) in err[0]


# ----------------------------------------------------------------------------- veil attack, no user Python
def _attack(tmp_path: Path, folder: Path, attack: str, batch: int, data: str, samples: int = 2) -> dict[str, float]:
    cfg = tmp_path / f"{attack}.yaml"
    cfg.write_text(f"model: {{name: hf, path: {folder}, dropout: 0.0}}\ndata: {data}\ntrain: {{threads: 1}}\n")
    out = tmp_path / f"out-{attack}"
    argv = ["attack", str(cfg), "--attack", attack, "--batch-size", str(batch), "--samples", str(samples)]
    assert main([*argv, "--out", str(out), "--quiet"]) == 0
    return json.loads((out / "summary.json").read_text())["attacks"][attack]


SST2 = "{name: sst2, max_len: 16, train_size: 64, test_size: 32}"


@pytest.fixture(scope="module")
def gpt2_128(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_family("gpt2", tmp_path_factory.mktemp("g") / "gpt2", dim=128, depth=2, heads=4)


def test_cli_span_on_gpt2_folder_batch4(tmp_path, gpt2_128):
    rep = _attack(tmp_path, gpt2_128, "span", 4, SST2)
    assert rep["token_recovery"] >= 0.95, rep


def test_cli_april_on_vit_and_deit_folders_batch1(tmp_path, folders):
    for kind in ("vit", "deit"):
        assert _attack(tmp_path, folders[kind], "april", 1, "{name: digits}")["psnr"] >= 40, kind


def test_cli_presence_on_untied_embeddings(tmp_path, folders):
    for kind in ("bert", "llama"):
        assert _attack(tmp_path, folders[kind], "presence", 4, SST2)["presence_f1"] >= 0.95, kind


# ----------------------------------------------------------------------------- slow: every family's span
@pytest.fixture(scope="module")
def trained_encoders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("enc")
    return {k: write_from_minilm(k, root / k) for k in ("bert", "roberta", "distilbert")}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["bert", "roberta", "distilbert"])
def test_cli_span_on_encoder_folders_batch4(tmp_path, trained_encoders, kind):
    """Trained encoder weights in each family's layout (MiniLM's first two blocks): every sentence
    of a batch of 4 back, RoBERTa's offset included."""
    rep = _attack(tmp_path, trained_encoders[kind], "span", 4, SST2)
    assert rep["token_recovery"] >= 0.95, rep


def test_cli_span_on_llama_folder_refuses_in_one_line_and_span_unfrozen_runs(tmp_path, folders, capsys):
    """LLaMA has no position table (RoPE): the span attack, whose candidates are (token, slot)
    pairs, refuses in one line; span-unfrozen (token candidates on the MLP layers) runs."""
    cfg = tmp_path / "l.yaml"
    cfg.write_text(f"model: {{name: hf, path: {folders['llama']}, dropout: 0.0}}\ndata: {SST2}\n")
    argv = ["attack", str(cfg), "--batch-size", "2", "--samples", "1", "--quiet"]
    capsys.readouterr()
    assert main([*argv, "--attack", "span", "--out", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no position table" in err[0]
    assert main([*argv, "--attack", "span-unfrozen", "--out", str(tmp_path / "b")]) == 0


# ----------------------------------------------------------------------------- veil export --hf
@pytest.mark.parametrize("kind", ["roberta", "gpt2", "vit"])
def test_export_round_trip(tmp_path, folders, kind):
    """A trained run written back with save_pretrained: transformers loads it, and so does
    `model: {name: hf, path: DIR}`, both with the run's logits."""
    import transformers

    from veil.build import load_run

    image = kind == "vit"
    data = "{name: digits}" if image else "{name: sst2, max_len: 12, train_size: 32, test_size: 8}"
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        f"model: {{name: hf, path: {folders[kind]}, dropout: 0.0}}\ndata: {data}\n"
        "train: {epochs: 1, max_steps: 2, batch_size: 8, threads: 1}\n"
    )
    run = tmp_path / "run"
    assert main(["train", str(cfg), "--out", str(run), "--quiet"]) == 0
    out = tmp_path / "exported"
    assert main(["export", str(run), "--hf", str(out)]) == 0
    _, model, data_splits, _ = load_run(run)
    model.eval()
    batch = {k: v[:4] for k, v in data_splits.test.items()}
    with torch.no_grad():
        ref = model(batch)
    auto = {"vit": "AutoModelForImageClassification", "gpt2": "AutoModelForCausalLM"}.get(
        kind, "AutoModelForSequenceClassification"
    )
    loaded = getattr(transformers, auto).from_pretrained(str(out), local_files_only=True, attn_implementation="eager")
    loaded.eval()
    with torch.no_grad():
        if image:
            theirs = loaded(pixel_values=batch["pixels"]).logits
        else:
            theirs = loaded(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    back = create_model("hf", path=str(out), num_classes=data_splits.num_classes)
    back.eval()
    with torch.no_grad():
        again = back(batch)
    if kind == "gpt2":
        m = batch["attention_mask"].bool()
        ref, theirs, again = ref[m], theirs[m], again[m]
    assert torch.allclose(ref, theirs, atol=1e-5) and torch.allclose(ref, again, atol=1e-6)
    assert main(["export", str(run), "--hf", str(out)]) == 2  # not over an existing folder


def test_export_of_a_veil_preset_is_one_line(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: {name: vit-digits, dim: 16, depth: 1, heads: 2}\ndata: digits\ntrain: {max_steps: 1}\n")
    assert main(["train", str(cfg), "--out", str(tmp_path / "run"), "--quiet"]) == 0
    capsys.readouterr()
    assert main(["export", str(tmp_path / "run"), "--hf", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a Hugging Face model" in err[0]


def test_small_vocabulary_message_does_not_advise_the_tokenizer_the_data_has(tmp_path, capsys):
    """A 1,000-row GPT-2 fed WordPiece data: the one line names the data's tokenizer and does not
    advise data.tokenizer=wordpiece, which it already is."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "model: {name: hf-gpt2, vocab_size: 1000, dim: 32, depth: 1, heads: 2}\n"
        "data: {name: sst2, tokenizer: wordpiece, max_len: 12, train_size: 8, test_size: 4}\n"
    )
    assert (
        main(["attack", str(cfg), "--attack", "labels", "--samples", "1", "--out", str(tmp_path / "o"), "--quiet"]) == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "(wordpiece) has 30522" in err[0] and "use data.tokenizer=wordpiece" not in err[0], err


def test_missing_path_is_one_line(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: {name: hf}\ndata: {name: sst2, max_len: 12, train_size: 8, test_size: 4}\n")
    assert (
        main(["attack", str(cfg), "--attack", "labels", "--samples", "1", "--out", str(tmp_path / "o"), "--quiet"]) == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "path" in err[0], err
