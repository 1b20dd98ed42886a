"""The composition root: a validated `RunConfig` becomes live objects — data, a model sized by
the data, the attached defenses — and a run folder becomes that run with its trained weights.

It sits in veil's core and reaches every component by name through `veil.registry`, so the
layers above (training, the audit engine, federated and split learning, the commands) all build
a run the same way without any of them importing another to do it (docs/architecture.md).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from veil.config import RunConfig, load_config
from veil.errors import VeilError
from veil.io import load_model_weights, settle
from veil.registry import DATASETS, DEFENSES, MODELS, TUNERS
from veil.weights import Weights, choose

if TYPE_CHECKING:  # types only: the objects come from the registries
    from veil.data import DataSplits
    from veil.defenses import Defense
    from veil.models import VeilModel


def data_derived(model_name: str, data: DataSplits) -> dict[str, Any]:
    """Model options the data decides (unless the config sets them)."""
    opts = MODELS.keys(model_name)
    out: dict[str, Any] = {}
    if data.modality == "image":
        px = data.train["pixels"]
        out.update(in_chans=px.shape[1], image_size=px.shape[-1], num_classes=data.num_classes)
    else:
        tok = data.meta.get("tokenizer")
        out["num_classes"] = data.num_classes
        if tok is not None:
            out["vocab_size"] = tok.vocab_size
        out["max_len"] = max(int(data.train["input_ids"].shape[-1]), 16)  # (N, T), or (N, choices, T)
    return {k: v for k, v in out.items() if k in opts}


def build_model(cfg: RunConfig, data: DataSplits) -> VeilModel:
    """The config's model, sized by the data; a model that cannot take the data is one line."""
    name = cfg.model["name"]
    overrides = {k: v for k, v in cfg.model.items() if k != "name"}
    model = MODELS.create(name, **{**data_derived(name, data), **overrides})
    if model.modality != data.modality:
        raise VeilError(f"model {name!r} takes {model.modality} input but data {cfg.data['name']!r} is {data.modality}")
    if model.modality == "text":
        vocab = model.token_embedding().weight.shape[0]
        tok = data.meta.get("tokenizer")
        check_vocabulary(name, model, tok)
        if tok is not None and tok.vocab_size > vocab:
            name_of = getattr(tok, "name", type(tok).__name__)
            hint = (
                "use data.tokenizer=wordpiece (30,522 ids)"
                if name_of != "wordpiece" and vocab >= 30522
                else "drop model.vocab_size (the data sets it) or tokenize with a vocabulary the model has"
            )
            raise VeilError(
                f"model {name!r} has a vocabulary of {vocab} but the data's tokenizer ({name_of}) has {tok.vocab_size}; {hint}"
            )
        if data.train["input_ids"].shape[-1] > model.max_positions():
            raise VeilError(
                f"data sequences ({data.train['input_ids'].shape[-1]} tokens) are longer than model {name!r} allows; lower data.max_len"
            )
    return model


def check_vocabulary(name: str, model: VeilModel, tok: Any) -> None:
    """A model that carries its own tokenizer's vocabulary (``model: hf``) takes only data tokenized
    with the same one: ids of another vocabulary would index the wrong embedding rows silently."""
    own = getattr(model, "tokenizer_vocab", None)
    if own is None or tok is None or not hasattr(tok, "vocab") or tok.vocab() == own:
        return
    where = getattr(model, "source_dir", name)
    raise VeilError(
        f"model {name!r} ('{where}', its tokenizer: {len(own)} ids) and the data's tokenizer "
        f"({getattr(tok, 'name', type(tok).__name__)}, {tok.vocab_size} ids) have different vocabularies; "
        f"drop data.tokenizer (the model folder's is used) or set data.tokenizer={where}"
    )


def model_tokenizer(cfg: RunConfig) -> str | None:
    """The tokenizer folder the data takes from the model: ``model: {name: hf, path: DIR}`` with no
    data.tokenizer set, when DIR holds a tokenizer (image checkpoints have none)."""
    path = cfg.model.get("path") if cfg.model.get("name") == "hf" else None
    if path is None or "tokenizer" in cfg.data or "tokenizer" not in DATASETS.keys(cfg.data["name"]):
        return None
    folder = Path(path)
    files = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json")
    return str(folder) if any((folder / f).is_file() for f in files) else None


def build_data(cfg: RunConfig) -> DataSplits:
    """The config's data set; an empty train or test split is one line. Text data for a model
    folder (``model: hf``) is tokenized with the folder's tokenizer unless data.tokenizer is set."""
    args = {k: v for k, v in cfg.data.items() if k != "name"}
    folder_tok = model_tokenizer(cfg)
    if folder_tok is not None:
        args["tokenizer"] = folder_tok
    data = DATASETS.create(cfg.data["name"], **args)
    if len(data.train["labels"]) == 0 or len(data.test["labels"]) == 0:
        raise VeilError(f"data set {cfg.data['name']!r} has an empty train or test split")
    return data


def build_defenses(cfg: RunConfig) -> list[Defense]:
    """The config's defenses, built but not attached."""
    return [DEFENSES.create(d["name"], **{k: v for k, v in d.items() if k != "name"}) for d in cfg.defense]


def build_run(cfg: RunConfig, data: DataSplits | None = None) -> tuple[VeilModel, DataSplits, list[Defense]]:
    """Data, then a model sized for it (seeded by train.seed), its LoRA adapters (`train.lora`),
    then the attached defenses."""
    data = data if data is not None else build_data(cfg)
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg, data)
    model.label_smoothing = cfg.train.label_smoothing
    if cfg.train.lora:  # adapters before the defenses: they attach to what trains
        model = TUNERS.create("lora", model=model, base=dict(cfg.model), **cfg.train.lora)
    defenses = build_defenses(cfg)
    for d in defenses:
        d.attach(model)
    prepare_schedule(cfg, data, defenses)
    return model, data, defenses


def prepare_schedule(cfg: RunConfig, data: DataSplits, defenses: list[Defense]) -> None:
    """A DP defense given a target epsilon learns its sigma from the run's schedule (sample rate,
    steps) as soon as the run is built, so that a rebuilt run's client step (an attack cell, the
    census, `veil attack`) draws the noise the training drew. A defense given its sigma is left
    as built: a single client step divides by the batch it is handed (the training loop prepares
    the rest)."""
    n = len(data.train["labels"])
    steps = cfg.train.max_steps or cfg.train.epochs * math.ceil(n / cfg.train.batch_size)
    for d in defenses:
        if getattr(d, "poisson", False) and getattr(d, "noise_multiplier", 0.0) is None:
            d.prepare(n, cfg.train.batch_size, steps)


def load_run(
    run_dir: str | Path, overrides: list[str] | None = None, checkpoint: str | None = None
) -> tuple[RunConfig, VeilModel, DataSplits, list[Defense]]:
    """Rebuild a run with its finished model, or with the weights `checkpoint` names
    (`veil.weights.choose`: last | STEP | init); no finished model and no `checkpoint` is one line."""
    cfg, model, data, defenses, _ = open_run(run_dir, overrides, checkpoint)
    return cfg, model, data, defenses


def open_run(
    run_dir: str | Path, overrides: list[str] | None = None, checkpoint: str | None = None
) -> tuple[RunConfig, VeilModel, DataSplits, list[Defense], Weights]:
    """`load_run`, and the `Weights` it read (their step, for the command's summary.json)."""
    run_dir = Path(run_dir)
    if not run_dir.exists():
        raise VeilError(f"run folder '{run_dir}' does not exist")
    if not run_dir.is_dir():
        raise VeilError(f"'{run_dir}' is a file; give a run folder written by `veil train`")
    if not (run_dir / "config.yaml").is_file():
        raise VeilError(f"'{run_dir}' is not a veil run folder (it has no config.yaml written by `veil train`)")
    cfg = load_config(run_dir, overrides)
    settle(run_dir / "checkpoints")  # a checkpoint a kill left half-moved is completed first
    weights = choose(run_dir, checkpoint)  # before the data loads: a wrong folder fails at once
    model, data, defenses = build_run(cfg)
    if weights.path is not None:
        load_model_weights(model, weights.path)
    return cfg, model, data, defenses, weights
