"""`model: {name: hf, path: DIR}`: a user's own Hugging Face checkpoint folder behind veil's handles.

The folder is what ``save_pretrained`` writes: ``config.json`` (its ``model_type`` picks the
family adapter), the weights as safetensors, and for text models the tokenizer. Nothing is
downloaded (``local_files_only``) and nothing is unpickled: a folder with only
``pytorch_model.bin`` is refused in one line. Attention is eager (double backward on CPU).

Families (`FAMILIES`): bert, roberta, distilbert (sequence classification encoders), gpt2 (causal
LM), llama / mistral / qwen2 (the LLaMA block: RoPE, RMSNorm, SwiGLU), vit and deit (image
classification). The task head follows the data: the run's ``num_classes`` is asked of
``from_pretrained``; a checkpoint whose head has another class count, or none, gets a fresh
head, said on stderr. ``dropout`` sets every dropout probability of the config (stock configs
carry 0.1; gradient-matching attacks assume none, see `span-robust`). The data is tokenized with
the folder's own tokenizer (`veil.build.build_data` passes ``data.tokenizer: DIR``), and a data
tokenizer with another vocabulary is refused by `veil.build.build_model`.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from veil.errors import VeilError
from veil.models.base import VeilModel
from veil.models.shapes import check_architecture
from veil.registry import MODELS

#: model_type -> (transformers class, the config keys `dropout` sets)
_BERT_DROP = ("hidden_dropout_prob", "attention_probs_dropout_prob", "classifier_dropout")
FAMILIES: dict[str, tuple[str, tuple[str, ...]]] = {
    "bert": ("BertForSequenceClassification", _BERT_DROP),
    "roberta": ("RobertaForSequenceClassification", _BERT_DROP),
    "distilbert": ("DistilBertForSequenceClassification", ("dropout", "attention_dropout", "seq_classif_dropout")),
    "gpt2": ("GPT2LMHeadModel", ("resid_pdrop", "embd_pdrop", "attn_pdrop")),
    "llama": ("LlamaForCausalLM", ("attention_dropout",)),
    "mistral": ("MistralForCausalLM", ("attention_dropout",)),
    "qwen2": ("Qwen2ForCausalLM", ("attention_dropout",)),
    "vit": ("ViTForImageClassification", ("hidden_dropout_prob", "attention_probs_dropout_prob")),
    "deit": ("DeiTForImageClassification", ("hidden_dropout_prob", "attention_probs_dropout_prob")),
}
CLASSIFIERS = ("bert", "roberta", "distilbert", "vit", "deit")
TEXT = ("bert", "roberta", "distilbert", "gpt2", "llama", "mistral", "qwen2")
POOLED = ("bert", "roberta")


def read_config(path: str | Path) -> dict[str, Any]:
    """The folder's config.json; one line when the folder, the file or its model_type is missing,
    or the family is not supported."""
    folder = Path(path)
    if not folder.is_dir():
        raise VeilError(
            f"model.path '{path}' is not a folder (a Hugging Face checkpoint folder written by save_pretrained)"
        )
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        raise VeilError(f"model.path '{path}' has no config.json (not a Hugging Face checkpoint folder)")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise VeilError(f"model.path '{path}': config.json is not valid JSON") from None
    kind = cfg.get("model_type") if isinstance(cfg, dict) else None
    if kind not in FAMILIES:
        raise VeilError(
            f"model.path '{path}': model_type {kind!r} is not supported; supported families: {', '.join(FAMILIES)}"
        )
    return cfg


def check_weights(path: str | Path) -> None:
    """Safetensors weights present; a folder with only pickled weights is refused (never unpickled)."""
    folder = Path(path)
    if (folder / "model.safetensors").is_file() or (folder / "model.safetensors.index.json").is_file():
        return
    if any(folder.glob("pytorch_model*.bin")):
        raise VeilError(
            f"model.path '{path}' holds only pytorch_model.bin (a pickle, which veil never loads); "
            "convert it to model.safetensors (save_pretrained(DIR, safe_serialization=True))"
        )
    raise VeilError(f"model.path '{path}' has no model.safetensors")


def folder_tokenizer(path: str | Path) -> Any:
    """The folder's tokenizer (AutoTokenizer, local files only); one line when it has none."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, TypeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise VeilError(f"model.path '{path}': no usable tokenizer in the folder ({first[:160]})") from None


def tokenizer_specials(tok: Any) -> tuple[int, int, int]:
    """(pad, start, end) ids as veil's data lays text out: start tokens end, then padding. Start is
    [CLS] / <s> / BOS, end [SEP] / </s> / EOS; padding falls back to end when the tokenizer has none."""
    start = tok.cls_token_id if tok.cls_token_id is not None else tok.bos_token_id
    end = tok.sep_token_id if tok.sep_token_id is not None else tok.eos_token_id
    if start is None or end is None:
        raise VeilError(
            f"tokenizer of '{tok.name_or_path}' has no {'start' if start is None else 'end'} token "
            "(cls_token / bos_token, sep_token / eos_token); set one in its tokenizer_config.json"
        )
    pad = tok.pad_token_id if tok.pad_token_id is not None else end
    return int(pad), int(start), int(end)


def say(msg: str) -> None:
    """One line on stderr, as veil's other notices."""
    print(f"veil: {msg}", file=sys.stderr)


def load_hf(
    path: str,
    num_classes: int | None = None,
    image_size: int | None = None,
    in_chans: int | None = None,
    dropout: float | None = None,
    pooling: str | None = None,
) -> VeilModel:
    """A Hugging Face checkpoint folder (`save_pretrained`) behind veil's handles, by its model_type.

    path: the checkpoint folder (config.json, model.safetensors and, for text, the tokenizer).
    num_classes: classes of the head (the data sets it; another count than the checkpoint's gets a fresh head).
    image_size: the data's image side (checked against the config).
    in_chans: the data's channels (checked against the config).
    dropout: every dropout probability of the config (unset: the checkpoint's own).
    pooling: bert / roberta: cls (the first token) or mean (masked mean of the last layer); unset: the checkpoint's (cls).
    """
    import transformers

    cfg = read_config(path)
    kind = cfg["model_type"]
    check_weights(path)
    if dropout is not None:
        check_architecture("hf", dropout=dropout)
    if pooling is not None and (kind not in POOLED or pooling not in ("cls", "mean")):
        raise VeilError(f"model.pooling is cls or mean and applies to bert and roberta; got {pooling!r} for {kind}")
    if kind in ("vit", "deit"):
        _check_image(path, cfg, image_size, in_chans)
    cls_name, drop_keys = FAMILIES[kind]
    kw: dict[str, Any] = {k: float(dropout) for k in drop_keys} if dropout is not None else {}
    if kind in CLASSIFIERS and num_classes is not None:
        kw.update(num_labels=num_classes, ignore_mismatched_sizes=True)
    with _quiet():
        model, info = getattr(transformers, cls_name).from_pretrained(
            str(path),
            local_files_only=True,
            use_safetensors=True,
            attn_implementation="eager",
            output_loading_info=True,
            **kw,
        )
    _report_head(path, kind, cfg, info, num_classes)
    return _adapter(kind, model, path, pooling or cfg.get("veil_pooling") or "cls")


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """transformers' own load report (missing / mismatched keys) off: `_report_head` says what matters."""
    import transformers

    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        yield
    finally:
        transformers.logging.set_verbosity(level)


def _check_image(path: str | Path, cfg: dict[str, Any], image_size: int | None, in_chans: int | None) -> None:
    for key, want, have in (
        ("image_size", image_size, cfg.get("image_size")),
        ("num_channels", in_chans, cfg.get("num_channels")),
    ):
        if want is not None and have is not None and int(want) != int(have):
            raise VeilError(f"model.path '{path}' takes {key} {have}; the data has {want} (resize the data to match)")


def _report_head(
    path: str | Path, kind: str, cfg: dict[str, Any], info: dict[str, Any], num_classes: int | None
) -> None:
    """A fresh classification head is said on stderr; any other weight the folder lacks is an error."""
    missing = list(info.get("missing_keys") or []) + [k for k, *_ in (info.get("mismatched_keys") or [])]
    head = ("classifier", "score", "lm_head", "pre_classifier", "pooler")
    body = [k for k in missing if k.split(".")[0] not in head]
    if body:
        raise VeilError(f"model.path '{path}' does not hold every weight of a {kind} model (e.g. '{body[0]}')")
    mismatched = [k for k, *_ in (info.get("mismatched_keys") or [])]
    fresh = [k for k in missing if k.startswith(("classifier", "pre_classifier"))]
    if kind in CLASSIFIERS and fresh:
        had = len(cfg.get("id2label") or {}) or cfg.get("num_labels")
        why = f"the checkpoint's has {had} classes" if mismatched else "the checkpoint has none"
        say(f"model.path '{path}': a fresh {num_classes}-class head ({why})")


def _adapter(kind: str, model: Any, path: str | Path, pooling: str) -> VeilModel:
    from veil.models.hf import HFGPT2, HFBert, HFViT
    from veil.models.hf_decoders import HFLlamaFamily
    from veil.models.hf_encoders import HFDistilBert, HFRoberta
    from veil.models.hf_vision import HFDeiT

    if kind == "vit":
        out: VeilModel = HFViT(model)
    elif kind == "deit":
        out = HFDeiT(model)
    else:
        tok = folder_tokenizer(path)
        pad, start, end = tokenizer_specials(tok)
        specials = [pad, start, end]
        builders: dict[str, Callable[[], VeilModel]] = {
            "bert": lambda: HFBert(model, specials, pooling),
            "roberta": lambda: HFRoberta(model, specials, pooling),
            "distilbert": lambda: HFDistilBert(model, specials),
            "gpt2": lambda: HFGPT2(model, pad_id=pad),
        }
        out = builders.get(kind, lambda: HFLlamaFamily(model, pad_id=pad))()
        out.special_ids = specials
        #: the tokenizer's vocabulary: `veil.build.build_model` refuses data tokenized with another
        out.tokenizer_vocab = dict(tok.get_vocab())
    out.source_dir = str(path)
    out.family = kind
    return out


def save_hf(model: VeilModel, folder: str | Path, tokenizer: Any = None) -> Path:
    """Write `model` (an HF adapter) with ``save_pretrained`` (safetensors) and its tokenizer,
    loadable by transformers and by ``model: {name: hf, path: folder}``."""
    hf = getattr(model, "hf", None)
    if hf is None or not hasattr(hf, "save_pretrained"):
        raise VeilError(
            f"{type(model).__name__} is not a Hugging Face model; --hf exports hf, minilm, hf-bert, hf-gpt2 and hf-vit runs"
        )
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    layout = getattr(model, "hf_layout", None)
    pooling = getattr(model, "pooling", None)
    if pooling is not None:
        hf.config.veil_pooling = pooling  # read back by `load_hf` as the pooling default
    with layout() if layout is not None else contextlib.nullcontext():
        hf.save_pretrained(str(out), safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    return out


def _register() -> None:
    def build(**overrides: Any) -> VeilModel:
        if not overrides.get("path"):
            raise VeilError("model hf needs model.path: a Hugging Face checkpoint folder (save_pretrained)")
        return load_hf(**overrides)

    from veil.schema import options_of

    build.__doc__ = load_hf.__doc__
    build.options = set(options_of(load_hf))  # type: ignore[attr-defined]
    build.schema = lambda: options_of(load_hf)  # type: ignore[attr-defined]
    MODELS.register(
        "hf",
        "your Hugging Face checkpoint folder by path (model.path=DIR); families: " + ", ".join(FAMILIES),
    )(build)


_register()
