"""GPT-style causal decoder: token + learned position embeddings -> pre-LN causal blocks ->
final LayerNorm -> LM head.

The LM head is untied from the token embedding by default, so the token-embedding gradient
shows only the rows of tokens in the batch (tie it with ``tie_weights=True`` as GPT-2 does).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor, nn

from veil.models.base import Batch, VeilModel, attention_mask, padding_bias
from veil.models.blocks import Block, BlockHandles, Table
from veil.models.embedding import TokenConfig, TokenEmbedding


@dataclass
class DecoderConfig(TokenConfig):  # vocab_size, max_len, dim, depth, heads first (TokenConfig)
    mlp_ratio: float = 4.0
    dropout: float = 0.0
    tie_weights: bool = False
    pad_id: int = 0


class Decoder(TokenEmbedding, BlockHandles, VeilModel):
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

    def movable(self, batch: Batch) -> Tensor:
        return batch["attention_mask"].bool() & (batch["input_ids"] != self.cfg.pad_id)

    def assemble(self, tok: Tensor, pos: Tensor, batch: Batch) -> Tensor:
        return self.drop(tok + pos)

    def forward_from_embeddings(self, h: Tensor, batch: Batch) -> Tensor:
        bias = padding_bias(attention_mask(batch, h), causal=self.causal, dtype=h.dtype)
        for blk in self.blocks:
            h = blk(h, bias)
        return self.lm_head(self.norm(h))

    # handles (token_embedding, position_table: TokenEmbedding)
    def classifier(self) -> nn.Module:
        return self.lm_head
