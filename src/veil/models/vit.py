"""Vision Transformer: patch embedding -> [CLS] + learned positions -> pre-LN blocks -> head.

The patch embedding is a linear map of flattened patches (equal to a stride-p convolution),
so ``dL/dW_patch = G^T X`` holds in the open, where G is the gradient at the embedding output
and X the patch matrix: the identity the APRIL attack inverts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from veil.models.base import Batch, VeilModel
from veil.models.blocks import Block, BlockHandles, Table
from veil.models.embedding import PatchConfig, PatchEmbedding, patchify, unpatchify

#: patchify / unpatchify live in veil.models.embedding and are still imported from here
__all__ = ["ViT", "ViTConfig", "patchify", "unpatchify"]


@dataclass
class ViTConfig(PatchConfig):  # image_size, patch_size, in_chans, num_classes first (PatchConfig)
    dim: int = 192
    depth: int = 6
    heads: int = 3
    mlp_ratio: float = 4.0
    dropout: float = 0.0


class ViT(PatchEmbedding, BlockHandles, VeilModel):
    modality = "image"
    pos_offset = 1  # row 0 of the table is the [CLS] token's

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.setup_patches(cfg, "vit")
        self.cls = Table(1, cfg.dim)
        self.pos = Table(self.grid**2 + 1, cfg.dim)
        self.blocks = nn.ModuleList(
            Block(cfg.dim, cfg.heads, cfg.mlp_ratio, cfg.dropout, prenorm=True) for _ in range(cfg.depth)
        )
        self.norm = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.num_classes)

    # embedding step: patches, positions and movable from PatchEmbedding
    def assemble(self, tok: Tensor, pos: Tensor, batch: Batch) -> Tensor:
        cls = (self.cls.weight + self.pos.weight[:1]).expand(tok.shape[0], 1, -1)
        return torch.cat([cls, tok + pos], dim=1)

    def forward_from_embeddings(self, h: Tensor, batch: Batch) -> Tensor:
        for blk in self.blocks:
            h = blk(h)
        return self.head(self.norm(h)[:, 0])

    # handles (token_embedding, position_table, grid_shape: PatchEmbedding)
    def classifier(self) -> nn.Module:
        return self.head
