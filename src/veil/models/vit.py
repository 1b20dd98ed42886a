"""Vision Transformer: patch embedding -> [CLS] + learned positions -> pre-LN blocks -> head.

The patch embedding is a linear map of flattened patches (equal to a stride-p convolution),
so ``dL/dW_patch = G^T X`` holds in the open, where G is the gradient at the embedding output
and X the patch matrix: the identity the APRIL attack inverts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from veil.errors import VeilError
from veil.models.base import Batch, VeilModel
from veil.models.blocks import Block, BlockHandles, Table


@dataclass
class ViTConfig:
    image_size: int = 32
    patch_size: int = 4
    in_chans: int = 3
    num_classes: int = 10
    dim: int = 192
    depth: int = 6
    heads: int = 3
    mlp_ratio: float = 4.0
    dropout: float = 0.0


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


class ViT(BlockHandles, VeilModel):
    modality = "image"

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        if cfg.image_size % cfg.patch_size:
            raise VeilError(f"image_size {cfg.image_size} is not a multiple of patch_size {cfg.patch_size}")
        self.cfg = cfg
        self.grid = cfg.image_size // cfg.patch_size
        n = self.grid**2
        self.patch_embed = nn.Linear(cfg.in_chans * cfg.patch_size**2, cfg.dim)
        self.cls = Table(1, cfg.dim)
        self.pos = Table(n + 1, cfg.dim)
        self.blocks = nn.ModuleList(
            Block(cfg.dim, cfg.heads, cfg.mlp_ratio, cfg.dropout, prenorm=True) for _ in range(cfg.depth)
        )
        self.norm = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.num_classes)

    # embedding step
    def patches(self, pixels: Tensor) -> Tensor:
        return patchify(pixels, self.cfg.patch_size)

    def embed_tokens(self, batch: Batch) -> Tensor:
        return self.patch_embed(self.patches(batch["pixels"]))

    def position_embeddings(self, tok: Tensor) -> Tensor:
        return self.pos.weight[1:].unsqueeze(0)

    def movable(self, batch: Batch) -> Tensor:
        B = batch["pixels"].shape[0]
        return torch.ones(B, self.grid**2, dtype=torch.bool, device=batch["pixels"].device)

    def assemble(self, tok: Tensor, pos: Tensor, batch: Batch) -> Tensor:
        cls = (self.cls.weight + self.pos.weight[:1]).expand(tok.shape[0], 1, -1)
        return torch.cat([cls, tok + pos], dim=1)

    def forward_from_embeddings(self, h: Tensor, batch: Batch) -> Tensor:
        for blk in self.blocks:
            h = blk(h)
        return self.head(self.norm(h)[:, 0])

    # handles
    def token_embedding(self) -> nn.Module:
        return self.patch_embed

    def position_table(self) -> nn.Parameter:
        return self.pos.weight

    def classifier(self) -> nn.Module:
        return self.head

    @property
    def grid_shape(self) -> tuple[int, int]:
        return (self.grid, self.grid)
