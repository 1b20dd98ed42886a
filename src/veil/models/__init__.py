"""Model registry: `create_model(name, **overrides)` / `list_models()` over veil's presets.

The presets register into `veil.registry.MODELS` here, the Hugging Face builders in
`veil.models.hf` (the registry imports both on its first lookup; transformers loads only then).

Overrides are the fields of the preset's config dataclass (or the HF builder's keywords); the
data decides `num_classes`, `in_chans`, `image_size` and `vocab_size` when a run builds a model.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

from veil.errors import VeilError
from veil.models import pretrained
from veil.models.base import AttentionHandles, Batch, VeilModel, linear_weight
from veil.models.cnn import CNN, CNNConfig
from veil.models.decoder import Decoder, DecoderConfig
from veil.models.llama import Llama, LlamaConfig
from veil.models.shapes import check_architecture
from veil.models.swin import Swin, SwinConfig
from veil.models.text_encoder import TextEncoder, TextEncoderConfig
from veil.models.vit import ViT, ViTConfig, patchify, unpatchify
from veil.registry import MODELS
from veil.schema import Option, options_of


def _preset(name: str, cls: type, cfg_cls: type, help: str, **defaults: Any) -> None:
    fields = {f.name for f in dataclasses.fields(cfg_cls)}

    def build(**overrides: Any) -> VeilModel:
        init = overrides.pop("init", None)  # unknown keys: refused by `MODELS.create` (its `options` below)
        opts = {**defaults, **overrides} if init is None else pretrained.merged_options(name, init, defaults, overrides)
        stale = sorted(set(opts) - fields)
        if stale:
            raise VeilError(f"model.init '{init}' has option {stale[0]!r}, which model {name!r} no longer takes")
        cfg = cfg_cls(**opts)
        check_architecture(name, **dataclasses.asdict(cfg))
        model = cls(cfg)
        if init is not None:
            pretrained.load_into(model, init)
        return model

    def schema() -> dict[str, Option]:
        init = Option("init", str | None, None, "a checkpoint folder from `veil pretrain` to start from")
        return {**options_of(cfg_cls, defaults), "init": init}

    build.__doc__ = help
    build.options = fields | {"init"}  # type: ignore[attr-defined]
    build.schema = schema  # type: ignore[attr-defined]
    MODELS.register(name, help)(build)


def register_hf_builder(name: str, builder: Callable[..., VeilModel], help: str) -> None:
    params = set(inspect.signature(builder).parameters)

    def build(**overrides: Any) -> VeilModel:  # unknown keys: refused by `MODELS.create` (its `options`)
        defaults = {k: p.default for k, p in inspect.signature(builder).parameters.items() if p.default is not p.empty}
        check_architecture(name, **{**defaults, **overrides})
        return builder(**overrides)

    build.options = params  # type: ignore[attr-defined]
    build.schema = lambda: options_of(builder)  # type: ignore[attr-defined]
    MODELS.register(name, help)(build)


#: veil's own presets: name -> (model class, its config dataclass, the config fields it sets)
PRESETS: dict[str, tuple[type[VeilModel], type, dict[str, Any]]] = {
    "vit-digits": (
        ViT,
        ViTConfig,
        dict(image_size=8, patch_size=2, in_chans=1, dim=64, depth=4, heads=4, mlp_ratio=2.0),
    ),
    "vit-tiny": (ViT, ViTConfig, dict(image_size=32, patch_size=4, in_chans=3, dim=192, depth=6, heads=3)),
    "transformer4": (TextEncoder, TextEncoderConfig, dict(dim=96, depth=4, heads=4)),
    "bert-mini": (TextEncoder, TextEncoderConfig, dict(dim=256, depth=4, heads=4)),
    "gpt-tiny": (Decoder, DecoderConfig, dict(dim=128, depth=4, heads=4)),
    "resnet-tiny": (CNN, CNNConfig, dict(image_size=32, patch_size=2, in_chans=3, base_width=32, stages=2, blocks=1)),
    "swin-tiny": (
        Swin,
        SwinConfig,
        dict(image_size=32, patch_size=2, in_chans=3, dim=64, depth=2, stages=2, heads=4, window=2),
    ),
    "llama-tiny": (Llama, LlamaConfig, dict(dim=128, depth=4, heads=4, mlp_hidden=352)),
}
#: each preset's one-line help (`veil list`)
PRESET_HELP: dict[str, str] = {
    "vit-digits": "ViT for 8x8 grey digits: patch 2, width 64, depth 4",
    "vit-tiny": "ViT-Tiny width (192, 3 heads) for 32x32 inputs, patch 4, depth 6 (scaled from 12 for CPU)",
    "transformer4": "4-layer width-96 text encoder (the attack model of the MJP paper)",
    "bert-mini": "BERT-mini-like encoder: 4 layers, width 256, 4 heads",
    "gpt-tiny": "GPT-style causal LM: 4 layers, width 128, learned positions",
    "resnet-tiny": "ResNet-style CNN (GroupNorm, 2 stages of 1 basic block, width 32-64); MJP on it is the patch shuffle",
    "swin-tiny": "Swin-style ViT: absolute position embeddings, 2x2-patch windows (shifted every 2nd block), 2 stages of 2",
    "llama-tiny": "LLaMA-style causal LM: RoPE (no position table), RMSNorm, SwiGLU; 4 layers, width 128",
}
for _name, (_cls, _cfg, _defaults) in PRESETS.items():
    _preset(_name, _cls, _cfg, PRESET_HELP[_name], **_defaults)


def create_model(name: str, **overrides: Any) -> VeilModel:
    """Build the registered model `name` with config overrides."""
    return MODELS.create(name, **overrides)


def list_models() -> list[str]:
    return MODELS.names()


def model_schema(name: str) -> dict[str, Option]:
    """Model `name`'s options: type, default (the preset's) and help."""
    return MODELS.options(name)


def model_options(name: str) -> set[str]:
    """The override keys model `name` accepts."""
    return MODELS.keys(name)


__all__ = [
    "AttentionHandles",
    "Batch",
    "VeilModel",
    "linear_weight",
    "create_model",
    "list_models",
    "model_options",
    "model_schema",
    "ViT",
    "ViTConfig",
    "TextEncoder",
    "TextEncoderConfig",
    "Decoder",
    "DecoderConfig",
    "CNN",
    "CNNConfig",
    "Swin",
    "SwinConfig",
    "Llama",
    "LlamaConfig",
    "patchify",
    "unpatchify",
    "MODELS",
]
