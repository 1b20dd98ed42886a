"""BERT-like text encoder: token + learned position + segment embeddings -> LayerNorm ->
post-LN blocks -> [CLS] -> classification head.

Special ids follow the BERT WordPiece vocabulary convention ([PAD]=0, [CLS], [SEP]); the
word-level tokenizer uses the same slots so both tokenizers fit the same model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor, nn

from veil.models.base import Batch, VeilModel, padding_bias, special_tokens_movable
from veil.models.blocks import Block, BlockHandles, Table
from veil.models.embedding import TokenConfig, TokenEmbedding


@dataclass
class TextEncoderConfig(TokenConfig):  # vocab_size, max_len, dim, depth, heads first (TokenConfig)
    dim: int = 96
    mlp_ratio: float = 4.0
    num_classes: int = 2
    type_vocab: int = 2
    dropout: float = 0.0
    special_ids: list[int] = field(default_factory=lambda: [0, 101, 102])  # pad, cls, sep


class TextEncoder(TokenEmbedding, BlockHandles, VeilModel):
    modality = "text"

    def __init__(self, cfg: TextEncoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos = Table(cfg.max_len, cfg.dim)
        self.seg = nn.Embedding(cfg.type_vocab, cfg.dim)
        self.emb_norm = nn.LayerNorm(cfg.dim)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(
            Block(cfg.dim, cfg.heads, cfg.mlp_ratio, cfg.dropout, prenorm=False) for _ in range(cfg.depth)
        )
        self.head = nn.Linear(cfg.dim, cfg.num_classes)
        nn.init.normal_(self.tok.weight, std=0.02)
        nn.init.normal_(
            self.seg.weight, std=0.02
        )  # BERT's init; N(0, 1) would swamp token + position after the LayerNorm

    def movable(self, batch: Batch) -> Tensor:
        return special_tokens_movable(batch["input_ids"], batch["attention_mask"], self.cfg.special_ids)

    def assemble(self, tok: Tensor, pos: Tensor, batch: Batch) -> Tensor:
        types = batch.get("token_type_ids")
        seg = self.seg(types) if types is not None else self.seg.weight[0]
        return self.drop(self.emb_norm(tok + pos + seg))

    def forward_from_embeddings(self, h: Tensor, batch: Batch) -> Tensor:
        bias = padding_bias(batch["attention_mask"], causal=self.causal, dtype=h.dtype)
        for blk in self.blocks:
            h = blk(h, bias)
        return self.head(h[:, 0])

    # handles (token_embedding, position_table: TokenEmbedding)
    def classifier(self) -> nn.Module:
        return self.head

    def embedding_norm(self) -> nn.Module:
        """The LayerNorm applied to token + position + segment before the first block."""
        return self.emb_norm

    def segment_row(self) -> Tensor:
        return self.seg.weight[0]
