"""LLaMA-style causal decoder: token embedding -> pre-RMSNorm blocks with rotary attention (RoPE)
and a SwiGLU MLP -> final RMSNorm -> LM head (Touvron et al. 2023, "LLaMA").

Positions enter only through RoPE: each head's query and key at position t are rotated by the
angles ``t * theta^(-2i/d)`` before the dot product, so ``q_s . k_t`` depends on ``s - t`` alone.
There is no absolute position table: `position_table` refuses with one line, and the inputs of
the first block are ``RMSNorm(E[token])``, the same vector at every position. What that means
for each attack (the span attack's candidates become tokens, not (token, position) pairs) is
in docs/models.md.

The projections have no biases (LLaMA's choice). The SwiGLU expansion ``W_1`` (gate) and ``W_3``
(up) is one fused ``nn.Linear(D, 2H)`` split in the forward pass, so `mlp_up` is one module per
block and a defense that noises the expansion (AEGIS channel 3) covers both halves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from veil.errors import VeilError
from veil.models.base import Batch, NoPositionTable, VeilModel, attention_mask, padding_bias
from veil.models.blocks import BlockHandles
from veil.models.embedding import TokenConfig, TokenEmbedding


@dataclass
class LlamaConfig(TokenConfig):  # vocab_size, max_len, dim, depth, heads first (TokenConfig)
    mlp_hidden: int = 352  # SwiGLU hidden width (LLaMA: about 8/3 of dim, rounded)
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    dropout: float = 0.0
    tie_weights: bool = False
    pad_id: int = 0


def rope_angles(max_len: int, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos and sin, each (max_len, head_dim), of the rotation angles t * theta^(-2i/d)."""
    freqs = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    ang = torch.arange(max_len, dtype=torch.float64)[:, None] * freqs[None]
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos().float(), ang.sin().float()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate (B, H, T, d) by the angles of positions 0..T-1 (the rotate-half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class RopeAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.q = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.k = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.v = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.o = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor, bias: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        B, T, D = x.shape
        hd = D // self.heads
        split = lambda t: t.view(B, T, self.heads, hd).transpose(1, 2)  # noqa: E731
        q = apply_rope(split(self.q(x)), cos, sin)
        k = apply_rope(split(self.k(x)), cos, sin)
        scores = q @ k.transpose(-2, -1) / math.sqrt(hd) + bias
        att = self.drop(scores.softmax(dim=-1))
        return self.o((att @ split(self.v(x))).transpose(1, 2).reshape(B, T, D))


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)), gate and up fused in `w13`."""

    def __init__(self, dim: int, hidden: int, dropout: float) -> None:
        super().__init__()
        self.w13 = nn.Linear(dim, 2 * hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.drop(self.w2(nn.functional.silu(gate) * up))

    def expansion(self) -> nn.Module:
        return self.w13

    def contraction(self) -> nn.Module:
        return self.w2


class LlamaBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.ln1 = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attn = RopeAttention(cfg)
        self.ln2 = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.mlp = SwiGLU(cfg.dim, cfg.mlp_hidden, cfg.dropout)

    def forward(self, x: Tensor, bias: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x), bias, cos, sin)
        return x + self.mlp(self.ln2(x))

    def input_norm(self) -> nn.Module:
        return self.ln1


class Llama(TokenEmbedding, BlockHandles, VeilModel):
    modality = "text"
    task = "lm"
    causal = True
    absolute_positions = False

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        if cfg.dim // cfg.heads % 2:
            raise VeilError(f"llama: RoPE needs an even head width, got dim {cfg.dim} / heads {cfg.heads}")
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.depth))
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        nn.init.normal_(self.tok.weight, std=0.02)
        if cfg.tie_weights:
            self.lm_head.weight = self.tok.weight
        cos, sin = rope_angles(cfg.max_len, cfg.dim // cfg.heads, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def position_embeddings(self, tok: Tensor) -> Tensor:
        """No absolute positions: zeros, so a transform that moves tokens moves only content."""
        return tok.new_zeros(1, tok.shape[1], tok.shape[2])

    def movable(self, batch: Batch) -> Tensor:
        return batch["attention_mask"].bool() & (batch["input_ids"] != self.cfg.pad_id)

    def assemble(self, tok: Tensor, pos: Tensor, batch: Batch) -> Tensor:
        return self.drop(tok + pos)

    def forward_from_embeddings(self, h: Tensor, batch: Batch) -> Tensor:
        length = h.shape[1]
        if length > self.cfg.max_len:
            raise VeilError(f"llama: a sequence of {length} tokens is longer than max_len {self.cfg.max_len}")
        bias = padding_bias(attention_mask(batch, h), causal=True, dtype=h.dtype)
        cos, sin = self.rope_cos[:length].to(h.dtype), self.rope_sin[:length].to(h.dtype)
        for blk in self.blocks:
            h = blk(h, bias, cos, sin)
        return self.lm_head(self.norm(h))

    # handles (token_embedding: TokenEmbedding; attention_layers, mlp_up, mlp_down, layer_input_norms:
    # BlockHandles over the blocks' attention, SwiGLU and ln1)
    def position_table(self) -> nn.Parameter:
        raise NoPositionTable("llama", "RoPE rotates queries and keys instead")

    def max_positions(self) -> int:
        return self.cfg.max_len

    def classifier(self) -> nn.Module:
        return self.lm_head

    @property
    def width(self) -> int:
        return self.cfg.dim
