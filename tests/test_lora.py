"""LoRA fine-tuning (`train.lora`, veil.models.lora): adapters on every family start where the base
is (B = 0), only they train, checkpoints hold them alone with a reference to the base, a resumed
run ends bit-identical, FedAvg on Flower exchanges the adapters only, bad settings are one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from helpers import SMALL, batch_for
from veil.build import build_run, load_run
from veil.config import load_config
from veil.errors import VeilError
from veil.io import load_model_weights, save_model_weights
from veil.models import create_model
from veil.models.lora import apply_lora, exchanged_state, state_digest
from veil.training.loop import train

LM = ["data=sst2", "data.train_size=64", "data.test_size=16", "data.max_len=12"]
LLAMA = ["model=llama-tiny", "model.dim=64", "model.depth=2", "model.mlp_hidden=96", *LM]
GPT2 = ["model=hf-gpt2", "model.dim=64", "model.depth=2", *LM]
RUN = ["train.epochs=2", "train.batch_size=16", "train.lr=0.003", "train.eval_batch_size=64", "train.threads=1"]


@pytest.mark.parametrize("name", ["llama-tiny", "hf-gpt2", "gpt-tiny", "transformer4", "minilm"])
def test_adapters_start_at_the_base_and_only_they_train(name: str) -> None:
    torch.manual_seed(0)
    model = create_model(name, **SMALL[name]).eval()
    batch = batch_for(model)
    before = model(batch)
    apply_lora(model, r=8)
    assert torch.equal(model(batch), before)  # B = 0: exactly the base's logits
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    adapters = [n for n in trained if ".lora_A." in n or ".lora_B." in n]
    head = {n for n, p in model.named_parameters() if any(p is q for q in model.classifier().parameters())}
    # every attention projection and MLP layer adapted; a classification head trains beside them, an LM head does not
    assert len(adapters) == 2 * len({id(m) for m in model.modules() if hasattr(m, "lora_A")}) >= 2 * 4
    assert set(trained) - set(adapters) == (head if model.task == "classification" else set())


def test_targets_by_handle_and_by_layer_name() -> None:
    model = create_model("llama-tiny", **SMALL["llama-tiny"])
    apply_lora(model, r=4, targets=["q", "v"])
    adapted = sorted(n for n, m in model.named_modules() if hasattr(m, "lora_A"))
    assert adapted == ["blocks.0.attn.q", "blocks.0.attn.v", "blocks.1.attn.q", "blocks.1.attn.v"]
    gpt2 = apply_lora(create_model("hf-gpt2", **SMALL["hf-gpt2"]), r=4, targets=["c_attn"])
    assert sorted(n for n, m in gpt2.named_modules() if hasattr(m, "lora_A")) == [
        "hf.transformer.h.0.attn.c_attn",
        "hf.transformer.h.1.attn.c_attn",
    ]
    assert gpt2.hf.transformer.h[0].attn.c_attn.fan_in_fan_out  # HF Conv1D: stored (in, out)


@pytest.mark.parametrize(
    "override, words",
    [
        ("train.lora.r=0", "train.lora.r must be an integer >= 1"),
        ("train.lora.rank=8", "unknown config key 'train.lora.rank'; allowed: alpha, dropout, head, r, targets"),
        ("train.lora.dropout=1.5", "train.lora.dropout must be in [0, 1)"),
        ("train.lora.targets=[q, nope]", "train.lora.targets: 'nope' selects no linear layer"),
        ("train.lora.r=eight", "config key 'train.lora.r' must be int"),
        ("train.lora=8", "config key 'train.lora' must be dict"),
    ],
)
def test_bad_lora_settings_are_one_line(override: str, words: str) -> None:
    with pytest.raises(VeilError) as e:
        build_run(load_config(None, [*LLAMA, override]))
    assert words in str(e.value) and "\n" not in str(e.value)


def test_bad_lora_setting_on_the_cli_exits_2_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from veil.cli import main

    cfg = tmp_path / "lora.yaml"
    cfg.write_text("model: {name: llama-tiny}\ndata: {name: sst2}\ntrain: {lora: {r: 0}}\n")
    assert main(["train", str(cfg), "--out", str(tmp_path / "run"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("veil: error: train.lora.r must be an integer >= 1") and "\n" not in err


def test_checkpoint_holds_the_adapters_and_a_reference_to_the_base(tmp_path: Path) -> None:
    cfg = load_config(None, [*LLAMA, *RUN, "train.lora.r=8"])
    train(cfg, tmp_path / "run", progress=False)
    ck = tmp_path / "run" / "checkpoints"
    for name in ("model.safetensors", "last.safetensors"):
        with safe_open(str(ck / name), framework="pt") as f:
            keys, meta = list(f.keys()), f.metadata()
        assert keys and all(".lora_A." in k or ".lora_B." in k for k in keys)
        assert json.loads(meta["veil.base.model"])["name"] == "llama-tiny" and json.loads(meta["veil.lora"])["r"] == 8
    base, _, _ = build_run(load_config(None, [*LLAMA, *RUN]))  # the same seed: the same base weights
    assert meta["veil.base.sha256"] == state_digest(base.state_dict())
    full = sum(p.numel() for p in base.parameters())
    assert (ck / "model.safetensors").stat().st_size < 0.2 * 4 * full  # no second copy of the base
    _, model, _, _ = load_run(tmp_path / "run")  # the base rebuilt, the adapters loaded
    trained = dict(model.named_parameters())
    with safe_open(str(ck / "model.safetensors"), framework="pt") as f:
        assert all(torch.equal(trained[k], f.get_tensor(k)) for k in f.keys())  # noqa: SIM118 (a safetensors handle)
    # adapters of another base (another seed) are refused in one line, as is a whole-model load
    other, _, _ = build_run(load_config(None, [*LLAMA, *RUN, "train.lora.r=8", "train.seed=1"]))
    with pytest.raises(VeilError, match="trained on another base model"):
        load_model_weights(other, ck / "model.safetensors")
    with pytest.raises(VeilError, match="holds LoRA adapters only"):
        load_model_weights(base, ck / "model.safetensors")
    save_model_weights(base, tmp_path / "whole.safetensors")
    with pytest.raises(VeilError, match="holds a whole model"):
        load_model_weights(other, tmp_path / "whole.safetensors")


def _fed_messages(tmp_path: Path, out: str, *extra: str, monkeypatch: pytest.MonkeyPatch) -> tuple[list, dict]:
    from veil.federated.fedavg import server_app
    from veil.federated.fedavg.runner import federate
    from veil.federated.fedavg.task import load_spec

    seen: list[list[str]] = []
    real = server_app.message_bytes

    def record(msg):  # every message the server sends and receives, as serialised by Flower
        if "arrays" in msg.content:
            seen.append(list(msg.content["arrays"].keys()))
        return real(msg)

    monkeypatch.setattr(server_app, "message_bytes", record)
    cfg = tmp_path / "fed.yaml"
    cfg.write_text("federated: {clients: 2, rounds: 2, local_steps: 2, backend: inline, audit: []}\n")
    spec = load_spec(cfg, [*extra, "train.batch_size=8", "train.lr=0.003"])
    summary = federate(spec, tmp_path / out)
    return seen, summary


@pytest.mark.parametrize(
    "model, strategy", [(GPT2, "fedavg"), (LLAMA, "fedprox")], ids=["gpt2-fedavg", "llama-fedprox"]
)
def test_federated_rounds_exchange_the_adapters_only(
    tmp_path: Path, model: list[str], strategy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = [*model, *(["federated.strategy=fedprox", "federated.proximal_mu=0.1"] if strategy == "fedprox" else [])]
    seen, lora = _fed_messages(tmp_path, "lora", *run, "train.lora.r=8", monkeypatch=monkeypatch)
    assert lora["rounds"] == 2 and len(seen) == 8  # 2 rounds x 2 clients x (down, up)
    assert all(keys and all(".lora_A." in k or ".lora_B." in k for k in keys) for keys in seen)
    _, whole = _fed_messages(tmp_path, "whole", *run, monkeypatch=monkeypatch)
    lora_bytes = [e["bytes_up"] for e in _events(tmp_path / "lora") if e["event"] == "round"]
    whole_bytes = [e["bytes_up"] for e in _events(tmp_path / "whole") if e["event"] == "round"]
    assert max(lora_bytes) < 0.25 * min(whole_bytes)
    with safe_open(str(tmp_path / "lora" / "checkpoints" / "model.safetensors"), framework="pt") as f:
        assert all(".lora_" in k for k in f.keys())  # noqa: SIM118 (the server checkpoint: adapters too)


def _events(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def test_exchanged_state_is_everything_without_lora() -> None:
    model = create_model("gpt-tiny", **SMALL["gpt-tiny"])
    assert exchanged_state(model).keys() == model.state_dict().keys()


def test_split_learning_refuses_lora_in_one_line(tmp_path: Path) -> None:
    from veil.federated.split.spec import load_split_spec

    cfg = tmp_path / "split.yaml"
    cfg.write_text("model: {name: vit-digits}\ndata: {name: digits}\ntrain: {lora: {r: 4}}\nsplit: {protocol: festa}\n")
    with pytest.raises(VeilError, match="train.lora is not supported by split learning"):
        load_split_spec(cfg)
