"""The handles every veil model exposes, so defenses and attacks never touch model internals.

A batch is a dict of tensors:
  images: ``pixels`` (B, C, H, W) and ``labels`` (B,)
  text:   ``input_ids`` (B, T), ``attention_mask`` (B, T) and, for classification, ``labels`` (B,)

The embedding step (timm's ``_pos_embed`` idea) is split so a defense can intervene:

  tok = model.embed_tokens(batch)           # (B, N, D) content tokens in their input order
  pos = model.position_embeddings(tok)      # (1 or B, N, D) the position embedding of each slot
  movable = model.movable(batch)            # (B, N) which tokens a shuffle may move
  tok, pos = transform(tok, pos, movable)   # e.g. MJP: shuffle tokens, put E_unk at moved slots
  h = model.assemble(tok, pos, batch)       # add [CLS] / segment / norm as the model needs

Everything after ``assemble`` is unchanged by defenses that act on the embedding step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor, nn

from veil.errors import VeilError

Batch = dict[str, Tensor]


class NoPositionTable(VeilError, NotImplementedError):
    """Raised by `position_table` of a model without absolute position embeddings (CNN, RoPE).

    A `VeilError` (one line on the CLI) that is also a `NotImplementedError`, so code that
    already treats a missing handle as optional (e.g. the layers an inversion attack weighs)
    goes on without it."""

    def __init__(self, model: str, why: str) -> None:
        super().__init__(
            f"model {model} has no position table ({why}); attacks and defenses that read E_pos do not apply to it"
        )


class EmbeddingTransform(Protocol):
    def __call__(self, tok: Tensor, pos: Tensor, movable: Tensor) -> tuple[Tensor, Tensor]: ...


@dataclass
class AttentionHandles:
    """The four projections of one attention layer (nn.Linear or HF Conv1D; see `linear_weight`)."""

    q: nn.Module
    k: nn.Module
    v: nn.Module
    o: nn.Module


def linear_weight(module: nn.Module, tensor: Tensor | None = None) -> Tensor:
    """The weight (or a tensor shaped like it, e.g. its gradient) as (out_features, in_features).

    Hugging Face GPT-2's Conv1D stores weights as (in, out); nn.Linear as (out, in).
    """
    t = module.weight if tensor is None else tensor
    base = getattr(module, "base_layer", module)  # a LoRA layer (peft) reports its base layer's weight
    return t.t() if type(base).__name__ == "Conv1D" else t


#: batch key of the classifier's input, cached from a frozen encoder (`veil.training.frozen`)
FEATURES = "features"


class VeilModel(nn.Module):
    """Base class: the forward pass is written once in terms of the handles below."""

    modality: str = "image"  # "image" | "text"
    task: str = "classification"  # "classification" | "lm"
    causal: bool = False  # attention sees only earlier positions (decoders)
    label_smoothing: float = 0.0  # of the classification loss (train.label_smoothing)
    #: False for models without an absolute position table (CNN; RoPE decoders): their
    #: `position_table` raises a one-line VeilError and `position_embeddings` is zero
    absolute_positions: bool = True

    def __init__(self) -> None:
        super().__init__()
        self._embedding_transform: EmbeddingTransform | None = None

    # ---- the replaceable embedding step -------------------------------------------------
    @property
    def embedding_transform(self) -> EmbeddingTransform | None:
        """The transform applied inside `embed` (None: none installed)."""
        return self._embedding_transform

    def set_embedding_transform(self, fn: EmbeddingTransform | None) -> None:
        """Install (or with None remove) the one transform applied inside `embed`."""
        if fn is not None and self._embedding_transform is not None:
            raise VeilError("this model already has an embedding transform attached (a defense is attached twice?)")
        self._embedding_transform = fn

    def embed(self, batch: Batch) -> Tensor:
        tok = self.embed_tokens(batch)
        pos = self.position_embeddings(tok)
        if self._embedding_transform is not None:
            tok, pos = self._embedding_transform(tok, pos, self.movable(batch))
        return self.assemble(tok, pos, batch)

    def forward(self, batch: Batch) -> Tensor:
        if FEATURES in batch:  # the frozen encoder's output, computed once (veil.training.frozen)
            return self.classifier()(batch[FEATURES])
        return self.forward_from_embeddings(self.embed(batch), batch)

    # ---- to implement ---------------------------------------------------------------------
    def embed_tokens(self, batch: Batch) -> Tensor:
        raise NotImplementedError

    def position_embeddings(self, tok: Tensor) -> Tensor:
        raise NotImplementedError

    def movable(self, batch: Batch) -> Tensor:
        raise NotImplementedError

    def assemble(self, tok: Tensor, pos: Tensor, batch: Batch) -> Tensor:
        raise NotImplementedError

    def forward_from_embeddings(self, h: Tensor, batch: Batch) -> Tensor:
        raise NotImplementedError

    # handles
    def token_embedding(self) -> nn.Module:
        """Patch projection (vision) or token-embedding table (text)."""
        raise NotImplementedError

    def position_table(self) -> nn.Parameter:
        """The learnable position-embedding table, (num_positions, D)."""
        raise NotImplementedError

    def max_positions(self) -> int:
        """The longest sequence (or most tokens) the model takes: the position table's rows."""
        return int(self.position_table().reshape(-1, self.position_table().shape[-1]).shape[0])

    def attention_layers(self) -> list[AttentionHandles]:
        raise NotImplementedError

    def mlp_up(self) -> list[nn.Module]:
        """The MLP expansion layer (fc1 / intermediate / c_fc) of every block: one module per
        block, whose input is the MLP's input (SwiGLU with separate gate and up: the gate)."""
        raise NotImplementedError

    def mlp_up_groups(self) -> list[list[nn.Module]]:
        """Every MLP expansion module of every block, a list per block: `mlp_up`'s one, or
        several where a block has them (HF LLaMA's ``gate_proj`` and ``up_proj``). A defense
        that acts on the expansion (AEGIS channel 3) covers every module listed here."""
        return [[m] for m in self.mlp_up()]

    def mlp_down(self) -> list[nn.Module]:
        raise NotImplementedError

    def classifier(self) -> nn.Module:
        """The last layer whose gradient reveals labels."""
        raise NotImplementedError

    def layer_input_norms(self) -> list[nn.Module]:
        """For each block, the LayerNorm whose output feeds the Q/K/V projections (identity if none)."""
        raise NotImplementedError

    # ---- task -------------------------------------------------------------------------------
    def loss(self, logits: Tensor, batch: Batch) -> Tensor:
        if self.task == "lm":
            return lm_loss(logits, batch["input_ids"], batch.get("attention_mask"))
        return nn.functional.cross_entropy(logits, batch["labels"], label_smoothing=self.label_smoothing)

    @property
    def width(self) -> int:
        return self.position_table().shape[-1]


def lm_loss(logits: Tensor, ids: Tensor, mask: Tensor | None) -> Tensor:
    """Next-token cross-entropy, ignoring padding."""
    target = ids[:, 1:]
    if mask is not None:  # masked_fill, not boolean indexing: per-sample gradients (vmap) need it
        target = target.masked_fill(mask[:, 1:] == 0, -100)
    return nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=-100
    )


def padding_bias(mask: Tensor, causal: bool, dtype: torch.dtype) -> Tensor:
    """Additive attention bias (B, 1, T, T): -inf-like where a key is padding or in the future."""
    B, T = mask.shape
    allowed = mask[:, None, None, :].bool().expand(B, 1, T, T)
    if causal:
        allowed = allowed & torch.ones(T, T, dtype=torch.bool, device=mask.device).tril()
    return torch.zeros(B, 1, T, T, dtype=dtype, device=mask.device).masked_fill(~allowed, torch.finfo(dtype).min)


def attention_mask(batch: Batch, h: Tensor) -> Tensor:
    """The batch's ``attention_mask``, or all ones over `h`'s (B, T) when it has none."""
    mask = batch.get("attention_mask")
    return torch.ones(h.shape[:2], dtype=torch.long, device=h.device) if mask is None else mask


def special_tokens_movable(ids: Tensor, mask: Tensor, special_ids: list[int]) -> Tensor:
    """True for real, non-special tokens: [CLS], [SEP] and padding never move."""
    special = torch.isin(ids, torch.tensor(special_ids, device=ids.device))
    return mask.bool() & ~special
