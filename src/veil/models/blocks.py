"""Transformer blocks shared by veil's own models: eager attention with separate Q/K/V/O linears.

Separate ``nn.Linear`` projections (not ``nn.MultiheadAttention``) give attacks and AEGIS a
handle on each projection and DP-SGD's per-sample engines a plain layer to differentiate
(`veil.defenses.dpsgd_engines`), and eager softmax attention supports the double backward that
gradient-matching attacks need on CPU.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from veil.errors import VeilError
from veil.models.base import AttentionHandles


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        if dim % heads:
            raise VeilError(f"width {dim} is not divisible by {heads} heads")
        self.heads = heads
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.o = nn.Linear(dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: Tensor, bias: Tensor | None = None) -> Tensor:
        B, T, D = x.shape
        split = lambda t: t.view(B, T, self.heads, D // self.heads).transpose(1, 2)  # noqa: E731
        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        scores = q @ k.transpose(-2, -1) / math.sqrt(D // self.heads)
        if bias is not None:
            scores = scores + bias
        att = self.drop(scores.softmax(dim=-1))
        return self.o((att @ v).transpose(1, 2).reshape(B, T, D))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop(self.fc2(self.act(self.fc1(x))))

    def expansion(self) -> nn.Module:
        """The layer that widens D to the hidden width (the MLP's `mlp_up` handle)."""
        return self.fc1

    def contraction(self) -> nn.Module:
        """The layer back to D (`mlp_down`)."""
        return self.fc2


class Block(nn.Module):
    """Pre-LN (ViT / GPT) or post-LN (BERT) Transformer block."""

    def __init__(self, dim: int, heads: int, mlp_ratio: float, dropout: float, prenorm: bool) -> None:
        super().__init__()
        self.prenorm = prenorm
        self.ln1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads, dropout)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim, int(dim * mlp_ratio), dropout)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: Tensor, bias: Tensor | None = None) -> Tensor:
        if self.prenorm:
            x = x + self.drop(self.attn(self.ln1(x), bias))
            return x + self.mlp(self.ln2(x))
        x = self.ln1(x + self.drop(self.attn(x, bias)))
        return self.ln2(x + self.mlp(x))

    def input_norm(self) -> nn.Module:
        """The module whose output feeds Q/K/V: ln1 when pre-LN; none (identity) when post-LN."""
        return self.ln1 if self.prenorm else nn.Identity()


class BlockHandles:
    """The handles of a model whose ``self.blocks`` are Transformer blocks (a mixin): each block has
    ``attn`` with ``q``/``k``/``v``/``o`` linears, ``mlp`` with ``expansion()`` / ``contraction()``
    and ``input_norm()`` (veil's `Block`; LLaMA's block with its SwiGLU)."""

    blocks: nn.ModuleList

    def attention_layers(self) -> list[AttentionHandles]:
        return [AttentionHandles(b.attn.q, b.attn.k, b.attn.v, b.attn.o) for b in self.blocks]

    def mlp_up(self) -> list[nn.Module]:
        return [b.mlp.expansion() for b in self.blocks]

    def mlp_down(self) -> list[nn.Module]:
        return [b.mlp.contraction() for b in self.blocks]

    def layer_input_norms(self) -> list[nn.Module]:
        return [b.input_norm() for b in self.blocks]


class Table(nn.Module):
    """A learnable table in a leaf module (a per-sample gradient engine sees it as one layer)."""

    def __init__(self, rows: int, dim: int, std: float = 0.02) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(rows, dim) * std)

    def forward(self) -> Tensor:
        return self.weight
