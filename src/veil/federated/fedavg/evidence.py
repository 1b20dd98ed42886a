"""What the auditor can say about a reconstruction without the client's data (a deployment's
server has no oracle): the reconstruction itself, saved to the run folder for a person to judge,
and signals computed from it and from the attack's own statistics.

    RUN_DIR/reconstructions/round<r>/client<c>-<attack>.png    images (a grid, one tile per sample)
    RUN_DIR/reconstructions/round<r>/client<c>-<attack>.json   tokens / text / labels

Signals (in each `audit` event, beside the attack's own `stats_*`):
  image_tv         mean total variation per pixel: natural images are smooth, noise is not
                   (Rudin, Osher & Fatemi 1992, the prior Inverting Gradients optimises)
  image_saturated  fraction of pixels at 0 or 1 (clamped: the optimisation hit the box)
  image_std        pixel standard deviation (0: a blank rebuild)
  tokens           tokens recovered (text); labels: the labels recovered
The attack's statistics (`stats_loss`: its final gradient-matching loss, `stats_rank`, ...) say
how well the reconstruction explains the update it was computed from: a low matching loss with a
smooth image is the auditor's strongest sign of leakage when no ground truth can score it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from veil.attacks import Reconstruction


def signals(rec: Reconstruction) -> dict[str, Any]:
    out: dict[str, Any] = {
        f"stats_{k}": float(v)
        for k, v in rec.stats.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "seconds"
    }
    if rec.images is not None and rec.images.numel():
        x = rec.images.detach().float().clamp(0, 1)
        tv = (x[..., 1:, :] - x[..., :-1, :]).abs().mean() + (x[..., :, 1:] - x[..., :, :-1]).abs().mean()
        out.update(
            image_tv=float(tv),
            image_saturated=float(((x <= 0) | (x >= 1)).float().mean()),
            image_std=float(x.std()),
        )
    if rec.token_ids is not None:
        out["tokens"] = int(sum(len(t) for t in rec.token_ids))
    if rec.labels is not None:
        out["labels"] = [int(v) for v in torch.as_tensor(rec.labels).reshape(-1).tolist()]
    return out


def save(rec: Reconstruction, stem: Path, tokenizer: Any = None) -> list[str]:
    """Write the reconstruction next to `stem` (png for images, json for text / labels); the paths."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    written = []
    if rec.images is not None and rec.images.numel():
        path = stem.with_suffix(".png")
        grid(rec.images).save(path)
        written.append(str(path))
    if rec.token_ids is not None or rec.token_set is not None or rec.labels is not None:
        data: dict[str, Any] = {}
        if rec.token_ids is not None:
            data["token_ids"] = [list(map(int, t)) for t in rec.token_ids]
            if tokenizer is not None and hasattr(tokenizer, "decode"):
                data["text"] = [tokenizer.decode(t) for t in data["token_ids"]]
        if rec.token_set is not None:
            data["token_set"] = sorted(int(t) for t in rec.token_set)
        if rec.labels is not None:
            data["labels"] = [int(v) for v in torch.as_tensor(rec.labels).reshape(-1).tolist()]
        path = stem.with_suffix(".json")
        path.write_text(json.dumps(data))
        written.append(str(path))
    return written


def grid(images: torch.Tensor, pad: int = 1) -> Any:
    """(B, C, H, W) in [0, 1] -> one PIL image, the samples side by side in rows of up to 8."""
    from PIL import Image

    x = images.detach().float().clamp(0, 1).cpu().numpy()
    b, c, h, w = x.shape
    cols = min(b, 8)
    rows = -(-b // cols)
    canvas = np.ones((rows * (h + pad) + pad, cols * (w + pad) + pad, c), dtype=np.float32)
    for i in range(b):
        r, k = divmod(i, cols)
        canvas[pad + r * (h + pad) : pad + r * (h + pad) + h, pad + k * (w + pad) : pad + k * (w + pad) + w] = x[
            i
        ].transpose(1, 2, 0)
    arr = (canvas * 255).round().astype(np.uint8)
    return Image.fromarray(arr[..., 0] if c == 1 else arr)
