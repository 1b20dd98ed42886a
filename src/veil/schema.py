"""Options of a builder (a function, a class or a config dataclass), read from its signature:
name, type, default and a help line from its docstring. The config checks values against these
types (one line per bad value); `veil list --details NAME` prints them.

Only plain types are checked (int, float, bool, str, their unions with None, Literal); an option
of any other type is passed through to its builder, which checks it.
"""

from __future__ import annotations

import difflib
import inspect
import re
import types
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal, Union

from veil.errors import VeilError

REQUIRED = "(required)"
_SCALARS = (bool, int, float, str)
#: readable names of option types that are classes (`Option.type_name`)
_CLASS_NAMES = {"Path": "path", "PurePath": "path", "Tokenizer": "tokenizer"}

#: the help line of an option whose builder's docstring gives none, by option name: the meaning
#: these names have wherever veil's builders take them
COMMON_HELP = {
    # models
    "dim": "width of the token vectors",
    "depth": "number of Transformer blocks",
    "heads": "attention heads per block (dim must be divisible by heads)",
    "mlp_ratio": "MLP hidden width as a multiple of dim",
    "mlp_hidden": "MLP hidden width (SwiGLU)",
    "dropout": "dropout rate while training (0: none); the attacks that assume none check it",
    "num_classes": "number of output classes (default: the data's)",
    "vocab_size": "token vocabulary size (default: the data's tokenizer)",
    "max_len": "longest sequence in tokens",
    "image_size": "image side in pixels (default: the data's)",
    "patch_size": "patch side in pixels (must divide image_size)",
    "in_chans": "image channels (default: the data's)",
    "type_vocab": "number of segment (token type) embeddings",
    "special_ids": "token ids never moved by a shuffling defense (pad, [CLS], [SEP])",
    "tie_weights": "share the LM head's weight with the token embedding",
    "pad_id": "token id of padding",
    "rope_theta": "base of the rotary position embedding's frequencies",
    "norm_eps": "epsilon of the RMSNorm layers",
    "pooling": "sentence vector for the head: cls (the [CLS] token) or mean (mean over tokens)",
    "base_width": "channels of the first stage",
    "stages": "number of stages (each halves the grid)",
    "blocks": "residual blocks per stage",
    "groups": "GroupNorm groups",
    "window": "attention window side in patches",
    # defenses
    "seed": "seed of the defense's random draws",
    "sigma": "standard deviation of the Gaussian noise added to each exported gradient",
    "ratio": "share of each gradient tensor's smallest-magnitude entries set to zero, in [0, 1)",
    "enabled": "false: the permutation is the identity (zero strength)",
    "skip": "leading feature slots (e.g. [CLS]) never permuted",
    "variant": "mjp (shuffle + E_unk at the shuffled slots), shuffle (positions kept) or nope (no position embedding)",
    "pairs_per_token": "DRL: pairs of unshuffled slots drawn per token each step",
    "freeze_attention": "freeze the attention projections (closes the Q/K/V span channel)",
    "freeze_attention_bias": "freeze the attention projections' biases too",
    "embed_noise": "noise on the token-embedding gradient, as a factor of its largest clean row norm",
    "mlp_noise": "per-block noise on the MLP expansion gradient, as a factor of its clean scale",
    "head_noise": "noise on an untied LM head's gradient (default: embed_noise)",
    "mlp_down_noise": "noise on the MLP down-projection gradient (default: none)",
    "noised_lr": "learning-rate factor of the noised tables",
    "lr_scale": "learning-rate factor of every parameter",
    "clip": "per-sample gradient norm bound C",
    "noise_multiplier": "sigma: noise std as a multiple of C (give this or target_epsilon)",
    "target_epsilon": "epsilon the run must reach; the accountant picks sigma (give this or noise_multiplier)",
    "delta": "delta of the (epsilon, delta) guarantee (default: 1 / training samples)",
    "accountant": "privacy accountant: rdp or prv",
    "mode": "per-sample gradients: auto, ghost, hooks or functorch",
    "trainable": "regular expression over parameter names: train only those (the rest frozen)",
    "chunk": "samples per physical micro-batch of a logical batch",
}


@dataclass(frozen=True)
class Option:
    name: str
    type: Any  # the annotation (a type, a union, a Literal) or None when unannotated
    default: Any
    help: str = ""

    def type_name(self) -> str:
        return _type_name(self.type)


def options_of(builder: Callable[..., Any], defaults: dict[str, Any] | None = None) -> dict[str, Option]:
    """The keyword options `builder` takes; `defaults` override the signature's (a preset's)."""
    target = builder.__init__ if inspect.isclass(builder) and not _is_dataclass(builder) else builder
    try:
        sig = inspect.signature(builder)
    except (TypeError, ValueError):
        return {}
    try:
        hints = typing.get_type_hints(builder if _is_dataclass(builder) else target)
    except Exception:  # an annotation that does not evaluate here: leave the types unchecked
        hints = {}
    # a dataclass's help lines: its own docstring's over those of the dataclasses it extends
    docs = (
        [c.__doc__ for c in reversed(builder.__mro__) if _is_dataclass(c)]
        if _is_dataclass(builder)
        else [inspect.getdoc(builder)]
    )
    helps = {k: v for doc in docs for k, v in doc_help(inspect.cleandoc(doc or "")).items()}
    out: dict[str, Option] = {}
    for name, p in sig.parameters.items():
        if p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) or name == "self":
            continue
        default = REQUIRED if p.default is p.empty else p.default
        if defaults and name in defaults:
            default = defaults[name]
        out[name] = Option(name, hints.get(name), default, helps.get(name) or COMMON_HELP.get(name, ""))
    return out


def unknown_option(who: str, key: str, allowed: Iterable[str]) -> VeilError:
    """The one line for an option `who` does not take: the nearest allowed name, then all of them."""
    names = sorted(allowed)
    close = difflib.get_close_matches(str(key), names, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return VeilError(f"{who}: unknown option {key!r}{hint}; options: {', '.join(names) or 'none'}")


def _is_dataclass(obj: Any) -> bool:
    return inspect.isclass(obj) and hasattr(obj, "__dataclass_fields__")


def doc_help(doc: str) -> dict[str, str]:
    """`name: text` paragraphs of a docstring (the first sentence of each, which may run over
    several lines) by option name."""
    out: dict[str, str] = {}
    name, text = None, ""
    for line in doc.splitlines() + [""]:
        m = re.match(r"\s*([a-z_][a-z0-9_]*)(?: \([^)]*\))?: (.+)", line)
        if name is not None and (m or not line.strip() or re.search(r"\.(\s|$)", text)):
            out.setdefault(name, re.split(r"(?<=\.)\s", text.strip(), maxsplit=1)[0])
            name = None
        if m:
            name, text = m.group(1), m.group(2)
        elif name is not None:
            text += " " + line.strip()
    return out


def check_value(where: str, opt: Option, value: Any) -> None:
    """A one-line `VeilError` when `value` does not fit the option's plain type."""
    if opt.type is None or _fits(opt.type, value):
        return
    raise VeilError(f"config key '{where}' must be {_type_name(opt.type)}, got {value!r}")


def _fits(tp: Any, value: Any) -> bool:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return any(_fits(a, value) for a in typing.get_args(tp))
    if origin is Literal:
        return value in typing.get_args(tp)
    if tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    return True  # not a plain type: the builder checks it


def _type_name(tp: Any) -> str:
    if tp is None:
        return "any"
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return " or ".join("none" if a is type(None) else _type_name(a) for a in typing.get_args(tp))
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if tp in _SCALARS:
        return tp.__name__
    if inspect.isclass(tp):
        return _CLASS_NAMES.get(tp.__name__, tp.__name__)
    return str(tp).replace("typing.", "")
