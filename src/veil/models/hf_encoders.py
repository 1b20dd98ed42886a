"""Hugging Face text encoders beyond BERT behind veil's handles: RoBERTa and DistilBERT
(sequence classification), loaded from a user's checkpoint folder by `veil.models.hf_path`.

RoBERTa is BERT's architecture with two differences that matter to the handles:

- positions start at ``padding_idx + 1``: HF's slot t reads row ``t + padding_idx + 1`` of
  ``position_embeddings``. Attacks and defenses read `position_table()` by slot (row t = slot t),
  so the adapter stores the table shifted by that offset (row t holds HF's row t + offset; the
  offset rows move to the end) and shifts it back in `hf_layout` (what `veil export --hf` saves).
  Without the shift every recovered token sits ``offset`` slots late.
- the head is ``dense -> tanh -> out_proj`` on the first token; `classifier()` is ``out_proj``,
  the layer whose gradient reveals the labels.

DistilBERT has no segment (token-type) table and no pooler: the head is ``pre_classifier -> ReLU
-> dropout -> classifier`` on the first token. Its blocks are post-LN like BERT's.

The handles are properties that look the modules up in the HF model at each call, never stored
references, so wrapping a module (e.g. peft's LoRA layers) is seen by every defense and attack.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor, nn

from veil.models.base import AttentionHandles, Batch, VeilModel, padding_bias, special_tokens_movable
from veil.models.hf import HFBert


class HFRoberta(HFBert):
    """RobertaForSequenceClassification behind veil's handles (position table stored by slot)."""

    base = "roberta"
    legacy_prefixes = {}  # noqa: RUF012 - no checkpoint ever held second module paths

    def __init__(self, model: nn.Module, special_ids: list[int], pooling: str = "cls") -> None:
        super().__init__(model, special_ids, pooling)
        #: rows of HF's position table before slot 0's (padding_idx + 1)
        self.pos_offset = int(model.config.pad_token_id) + 1
        self._shift(-self.pos_offset)

    def _shift(self, rows: int) -> None:
        table = self._emb.position_embeddings.weight
        with torch.no_grad():
            table.copy_(torch.roll(table, rows, dims=0))

    @contextlib.contextmanager
    def hf_layout(self) -> Iterator[None]:
        """The HF model with its own position-table layout (for `save_pretrained`)."""
        self._shift(self.pos_offset)
        try:
            yield
        finally:
            self._shift(-self.pos_offset)

    def max_positions(self) -> int:
        return int(self._emb.position_embeddings.weight.shape[0]) - self.pos_offset

    def head(self, pooled: Tensor) -> Tensor:
        return self.hf.classifier(pooled.unsqueeze(1))  # RobertaClassificationHead reads token 0

    def classifier(self) -> nn.Module:
        return self.hf.classifier.out_proj


class HFDistilBert(VeilModel):
    """DistilBertForSequenceClassification behind veil's handles."""

    modality = "text"

    def __init__(self, model: nn.Module, special_ids: list[int]) -> None:
        super().__init__()
        self.hf = model
        self.special_ids = special_ids

    @property
    def _emb(self) -> nn.Module:
        return self.hf.distilbert.embeddings

    @property
    def _layers(self) -> nn.ModuleList:
        return self.hf.distilbert.transformer.layer

    def embed_tokens(self, batch: Batch) -> Tensor:
        return self._emb.word_embeddings(batch["input_ids"])

    def position_embeddings(self, tok: Tensor) -> Tensor:
        return self._emb.position_embeddings.weight[: tok.shape[1]].unsqueeze(0)

    def movable(self, batch: Batch) -> Tensor:
        return special_tokens_movable(batch["input_ids"], batch["attention_mask"], self.special_ids)

    def assemble(self, tok: Tensor, pos: Tensor, batch: Batch) -> Tensor:
        return self._emb.dropout(self._emb.LayerNorm(tok + pos))

    def forward_from_embeddings(self, h: Tensor, batch: Batch) -> Tensor:
        bias = padding_bias(batch["attention_mask"], causal=False, dtype=h.dtype)
        seq = self.hf.distilbert.transformer(h, attention_mask=bias).last_hidden_state
        pooled = nn.functional.relu(self.hf.pre_classifier(seq[:, 0]))
        return self.hf.classifier(self.hf.dropout(pooled))

    def token_embedding(self) -> nn.Module:
        return self._emb.word_embeddings

    def position_table(self) -> nn.Parameter:
        return self._emb.position_embeddings.weight

    def attention_layers(self) -> list[AttentionHandles]:
        return [
            AttentionHandles(b.attention.q_lin, b.attention.k_lin, b.attention.v_lin, b.attention.out_lin)
            for b in self._layers
        ]

    def mlp_up(self) -> list[nn.Module]:
        return [b.ffn.lin1 for b in self._layers]

    def mlp_down(self) -> list[nn.Module]:
        return [b.ffn.lin2 for b in self._layers]

    def classifier(self) -> nn.Module:
        return self.hf.classifier

    def layer_input_norms(self) -> list[nn.Module]:
        return [nn.Identity() for _ in self._layers]  # post-LN: the block input is already normed

    def embedding_norm(self) -> nn.Module:
        return self._emb.LayerNorm

    def segment_row(self) -> Tensor:
        """DistilBERT adds no segment embedding: a zero row."""
        return torch.zeros_like(self._emb.position_embeddings.weight[0])
