"""Shape rules every Transformer builder checks before building: one line per broken rule.

`check_architecture(model, **options)` reads the options it knows (width, heads, depth, patch
and image size, dropout, MLP ratio, sizes) and ignores the rest, so each builder (veil's presets
and the Hugging Face adapters) passes it everything it was given.
"""

from __future__ import annotations

from typing import Any

from veil.errors import VeilError

_POSITIVE = ("dim", "heads", "depth", "patch_size", "image_size", "in_chans", "num_classes", "vocab_size", "max_len")


def check_architecture(model: str, **opts: Any) -> None:
    """Raise a one-line `VeilError` naming the first broken rule of model `model`'s options."""
    for key in _POSITIVE:
        value = opts.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise VeilError(f"model {model!r}: {key} must be an integer >= 1, got {value!r}")
    dim, heads = opts.get("dim"), opts.get("heads")
    if dim is not None and heads is not None and dim % heads:
        near = sorted({max(heads, dim - dim % heads), dim - dim % heads + heads})
        raise VeilError(
            f"model {model!r}: dim {dim} is not divisible by heads {heads} (each head gets dim / heads channels); "
            f"try dim={' or dim='.join(map(str, near))}"
        )
    size, patch = opts.get("image_size"), opts.get("patch_size")
    if size is not None and patch is not None and size % patch:
        fits = [p for p in range(1, size + 1) if size % p == 0 and p > 1]
        raise VeilError(
            f"model {model!r}: patch_size {patch} does not divide the {size}x{size} image; "
            f"patch sizes that do: {', '.join(map(str, fits))}"
        )
    drop = opts.get("dropout")
    if drop is not None and not (isinstance(drop, (int, float)) and 0 <= drop < 1):
        raise VeilError(f"model {model!r}: dropout must be in [0, 1), got {drop!r}")
    ratio = opts.get("mlp_ratio")
    if ratio is not None and not (isinstance(ratio, (int, float)) and ratio > 0):
        raise VeilError(f"model {model!r}: mlp_ratio must be > 0, got {ratio!r}")
