"""Swin-style vision Transformer: patch embedding + absolute position embeddings -> stages of
windowed-attention blocks (every second block with windows shifted by half a window, Swin's
SW-MSA) -> patch merging between stages -> LayerNorm -> mean pool -> head (Liu et al. 2021).

Swin proper uses a relative position bias inside each window; this model uses Swin's optional
*absolute* position embedding (``ape=True`` in the reference code) instead, one learnable row
per patch, added right after the patch embedding. That is the table MJP masks: the MJP paper
applies its E_unk to a Swin's absolute positions (Table I). Without a [CLS] token the identity
``dL/dW_patch = G^T X`` with ``G = dL/dE_pos`` holds for every patch row, as in a ViT.

A block attends within non-overlapping ``window`` x ``window`` windows of the patch grid; a
shifted block rolls the grid by half a window first and masks the attention between patches
the roll brought together from opposite edges. Patch merging concatenates each 2 x 2
neighbourhood (4D) and maps it to 2D channels, halving the grid. Blocks are veil's pre-LN
`Block` run on the windows (LayerNorm and MLP act per token, so only attention sees windows).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from veil.errors import VeilError
from veil.models.base import Batch, VeilModel
from veil.models.blocks import Block, BlockHandles, Table
from veil.models.embedding import PatchConfig, PatchEmbedding


@dataclass
class SwinConfig(PatchConfig):  # image_size, patch_size, in_chans, num_classes first (PatchConfig)
    patch_size: int = 2
    dim: int = 64  # width of the first stage; each merge doubles it
    depth: int = 2  # blocks per stage (alternating plain and shifted windows)
    stages: int = 2
    heads: int = 4
    window: int = 4  # window side, in patches (cut to the grid where the grid is smaller)
    mlp_ratio: float = 2.0
    dropout: float = 0.0


def windows(x: Tensor, w: int) -> Tensor:
    """(B, K, K, D) -> (B * (K/w)^2, w*w, D), windows in row-major order per image."""
    B, K, _, D = x.shape
    x = x.view(B, K // w, w, K // w, w, D).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(-1, w * w, D)


def unwindows(x: Tensor, w: int, K: int) -> Tensor:
    """Inverse of `windows`."""
    D = x.shape[-1]
    x = x.view(-1, K // w, K // w, w, w, D).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(-1, K, K, D)


def shift_bias(K: int, w: int, s: int) -> Tensor:
    """(nW, 1, w*w, w*w) additive bias: -inf-like between patches from different regions after
    rolling the K x K grid by -s (Swin's SW-MSA mask)."""
    region = torch.zeros(K, K)
    cuts = (slice(0, K - w), slice(K - w, K - s), slice(K - s, K))
    for n, (r, c) in enumerate((r, c) for r in cuts for c in cuts):
        region[r, c] = n
    ids = windows(region[None, :, :, None], w).squeeze(-1)  # (nW, w*w)
    differ = ids[:, :, None] != ids[:, None, :]
    return torch.zeros(differ.shape).masked_fill(differ, torch.finfo(torch.float32).min)[:, None]


class SwinBlock(nn.Module):
    def __init__(self, dim: int, heads: int, grid: int, window: int, shift: bool, cfg: SwinConfig) -> None:
        super().__init__()
        self.grid, self.window = grid, window
        self.shift = window // 2 if shift and window < grid else 0
        self.block = Block(dim, heads, cfg.mlp_ratio, cfg.dropout, prenorm=True)
        bias = shift_bias(grid, window, self.shift) if self.shift else torch.zeros(0)
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        B, N, D = x.shape
        K, w, s = self.grid, self.window, self.shift
        g = x.view(B, K, K, D)
        if s:
            g = torch.roll(g, (-s, -s), dims=(1, 2))
        bias = self.bias.repeat(B, 1, 1, 1).to(x.dtype) if s else None
        g = unwindows(self.block(windows(g, w), bias), w, K)
        if s:
            g = torch.roll(g, (s, s), dims=(1, 2))
        return g.reshape(B, N, D)


class PatchMerging(nn.Module):
    """2 x 2 neighbouring patches (4D) -> LayerNorm -> Linear to 2D: half the grid, twice the width."""

    def __init__(self, dim: int, grid: int) -> None:
        super().__init__()
        self.grid = grid
        self.norm = nn.LayerNorm(4 * dim)
        self.reduce = nn.Linear(4 * dim, 2 * dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        B, _, D = x.shape
        K = self.grid
        g = x.view(B, K // 2, 2, K // 2, 2, D).permute(0, 1, 3, 4, 2, 5).reshape(B, (K // 2) ** 2, 4 * D)
        return self.reduce(self.norm(g))


class Swin(PatchEmbedding, BlockHandles, VeilModel):
    modality = "image"

    def __init__(self, cfg: SwinConfig) -> None:
        super().__init__()
        self.setup_patches(cfg, "swin")
        if cfg.stages < 1 or self.grid % 2 ** (cfg.stages - 1):
            raise VeilError(
                f"swin: the {self.grid}x{self.grid} patch grid cannot be halved {cfg.stages - 1} times "
                f"(stages must be >= 1 and 2^(stages-1) must divide image_size / patch_size)"
            )
        self.pos = Table(self.grid**2, cfg.dim)
        self.drop = nn.Dropout(cfg.dropout)
        blocks, stage_of, merges = [], [], []
        dim, grid = cfg.dim, self.grid
        for s in range(cfg.stages):
            w = min(cfg.window, grid)
            if grid % w:
                raise VeilError(f"swin: window {cfg.window} does not divide the stage-{s + 1} grid of {grid}x{grid}")
            for b in range(cfg.depth):
                blocks.append(SwinBlock(dim, cfg.heads, grid, w, b % 2 == 1, cfg))
                stage_of.append(s)
            if s < cfg.stages - 1:
                merges.append(PatchMerging(dim, grid))
                dim, grid = 2 * dim, grid // 2
        self.swin_blocks = nn.ModuleList(blocks)
        self.blocks = [b.block for b in blocks]  # for BlockHandles: a plain list, not registered twice
        self.merges = nn.ModuleList(merges)
        self.stage_of = stage_of
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, cfg.num_classes)

    # embedding step: patches, positions and movable from PatchEmbedding
    def assemble(self, tok: Tensor, pos: Tensor, batch: Batch) -> Tensor:
        return self.drop(tok + pos)

    def forward_from_embeddings(self, h: Tensor, batch: Batch) -> Tensor:
        for i, blk in enumerate(self.swin_blocks):
            h = blk(h)
            last_of_stage = i + 1 == len(self.swin_blocks) or self.stage_of[i + 1] != self.stage_of[i]
            if last_of_stage and self.stage_of[i] < len(self.merges):
                h = self.merges[self.stage_of[i]](h)
        return self.head(self.norm(h).mean(dim=1))

    # handles (token_embedding, position_table, grid_shape: PatchEmbedding)
    def classifier(self) -> nn.Module:
        return self.head

    @property
    def width(self) -> int:
        return self.cfg.dim
