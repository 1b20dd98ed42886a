"""The embedding step shared by veil's own models, each part its own method (timm's ``_pos_embed``).

`VeilModel.embed` runs ``tok = embed_tokens(batch)``, ``pos = position_embeddings(tok)``, the
defense's transform, then ``assemble`` (`veil.models.base`). The mixins here are the two ways
veil's models fill the first two steps and the handles that read them:

- `PatchEmbedding` (ViT, Swin): flattened ``p x p`` patches through one linear map, so
  ``dL/dW_patch = G^T X`` holds in the open (the identity APRIL inverts), and one learned row
  of the position table per patch, after the first `pos_offset` rows (ViT's [CLS] row).
- `TokenEmbedding` (TextEncoder, Decoder; Llama without its positions): a token table and
  learned absolute positions ``E_pos[:T]``.

A mixin adds methods only: no parameter, so a model's weights for a given seed do not depend on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from veil.errors import VeilError
from veil.models.base import Batch
from veil.models.blocks import Table

__all__ = ["PatchConfig", "PatchEmbedding", "TokenConfig", "TokenEmbedding", "patchify", "unpatchify"]


def patchify(x: Tensor, p: int) -> Tensor:
    """(B, C, H, W) -> (B, N, C*p*p), patches in row-major grid order."""
    B, C, H, W = x.shape
    x = x.reshape(B, C, H // p, p, W // p, p).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(B, (H // p) * (W // p), C * p * p)


def unpatchify(patches: Tensor, p: int, chans: int, size: int) -> Tensor:
    """Inverse of `patchify`."""
    B, N, _ = patches.shape
    k = size // p
    x = patches.reshape(B, k, k, chans, p, p).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(B, chans, size, size)


@dataclass
class PatchConfig:
    """The input and output fields of a patch model's config (the first fields of ViT's and Swin's)."""

    image_size: int = 32
    patch_size: int = 4
    in_chans: int = 3
    num_classes: int = 10


class PatchEmbedding:
    """Patch tokens and per-patch learned positions (a mixin over ``cfg.patch_size``,
    ``patch_embed``, ``pos`` and the side ``grid`` of the patch grid)."""

    cfg: PatchConfig | Any
    patch_embed: nn.Linear
    pos: Table
    grid: int
    #: rows of the position table before the patches' (ViT: 1, its [CLS] row)
    pos_offset: int = 0

    def setup_patches(self, cfg: PatchConfig | Any, model: str) -> None:
        """Keep `cfg`, the grid side and the patch projection (flattened patch -> ``cfg.dim``)."""
        if cfg.image_size % cfg.patch_size:
            raise VeilError(f"{model}: patch_size {cfg.patch_size} does not divide image_size {cfg.image_size}")
        self.cfg = cfg
        self.grid = cfg.image_size // cfg.patch_size
        self.patch_embed = nn.Linear(cfg.in_chans * cfg.patch_size**2, cfg.dim)

    def patches(self, pixels: Tensor) -> Tensor:
        return patchify(pixels, self.cfg.patch_size)

    def embed_tokens(self, batch: Batch) -> Tensor:
        return self.patch_embed(self.patches(batch["pixels"]))

    def position_embeddings(self, tok: Tensor) -> Tensor:
        return self.pos.weight[self.pos_offset :].unsqueeze(0)

    def movable(self, batch: Batch) -> Tensor:
        B = batch["pixels"].shape[0]
        return torch.ones(B, self.grid**2, dtype=torch.bool, device=batch["pixels"].device)

    def token_embedding(self) -> nn.Module:
        return self.patch_embed

    def position_table(self) -> nn.Parameter:
        return self.pos.weight

    @property
    def grid_shape(self) -> tuple[int, int]:
        return (self.grid, self.grid)


@dataclass
class TokenConfig:
    """The first fields of a token model's config (TextEncoder, Decoder, Llama)."""

    vocab_size: int = 30522
    max_len: int = 128  # the longest sequence: rows of the position table (Llama: of RoPE's cached angles)
    dim: int = 128
    depth: int = 4
    heads: int = 4


class TokenEmbedding:
    """Token-table tokens and learned absolute positions ``E_pos[:T]`` (a mixin over ``tok`` and
    ``pos``; a model without a position table overrides the two position methods)."""

    tok: nn.Embedding
    pos: Table

    def embed_tokens(self, batch: Batch) -> Tensor:
        return self.tok(batch["input_ids"])

    def position_embeddings(self, tok: Tensor) -> Tensor:
        return self.pos.weight[: tok.shape[1]].unsqueeze(0)

    def token_embedding(self) -> nn.Module:
        return self.tok

    def position_table(self) -> nn.Parameter:
        return self.pos.weight
