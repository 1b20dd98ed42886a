"""GPT-style causal decoder: token + learned position embeddings -> pre-LN causal blocks ->
final LayerNorm -> LM head.

The LM head is untied from the token embedding by default, so the token-embedding gradient
shows only the rows of tokens in the batch (tie it with ``tie_weights=True`` as GPT-2 does).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from veil.models.base import Batch, VeilModel, padding_bias
from veil.models.blocks import Block, BlockHandles, Table


@dataclass
class DecoderConfig:
    vocab_size: int = 30522
    max_len: int = 128
    dim: int = 128
    depth: int = 4
    heads: int = 4
    mlp_ratio: float = 4.0
    dropout: float = 0.0
    tie_weights: bool = False
    pad_id: int = 0


class Decoder(BlockHandles, VeilModel):
    modality = "text"
    task = "lm"
    causal = True

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos = Table(cfg.max_len, cfg.dim)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(
            Block(cfg.dim, cfg.heads, cfg.mlp_ratio, cfg.dropout, prenorm=True) for _ in range(cfg.depth)
        )
        self.norm = nn.LayerNorm(cfg.dim)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        nn.init.normal_(self.tok.weight, std=0.02)
        if cfg.tie_weights:
            self.lm_head.weight = self.tok.weight

    def embed_tokens(self, batch: Batch) -> Tensor:
        return self.tok(batch["input_ids"])

    def position_embeddings(self, tok: Tensor) -> Tensor:
        return self.pos.weight[: tok.shape[1]].unsqueeze(0)

    def movable(self, batch: Batch) -> Tensor:
        return batch["attention_mask"].bool() & (batch["input_ids"] != self.cfg.pad_id)

    def assemble(self, tok: Tensor, pos: Tensor, batch: Batch) -> Tensor:
        return self.drop(tok + pos)

    def forward_from_embeddings(self, h: Tensor, batch: Batch) -> Tensor:
        mask = batch.get("attention_mask")
        if mask is None:
            mask = torch.ones(h.shape[:2], dtype=torch.long, device=h.device)
        bias = padding_bias(mask, causal=self.causal, dtype=h.dtype)
        for blk in self.blocks:
            h = blk(h, bias)
        return self.lm_head(self.norm(h))

    def token_embedding(self) -> nn.Module:
        return self.tok

    def position_table(self) -> nn.Parameter:
        return self.pos.weight

    def classifier(self) -> nn.Module:
        return self.lm_head
