"""A multiple-choice head on the BERT-like text encoder (BERT's `ForMultipleChoice`, as the MJP
paper's Table VII fine-tunes BERT-base on SWAG).

A batch holds every choice of every item: ``input_ids`` / ``attention_mask`` /
``token_type_ids`` of shape (B, C, T) (`veil.data.multiple_choice`). The encoder runs on the
B * C sequences flattened to (B * C, T), a linear scorer maps each [CLS] output to one score,
and the (B, C) scores are the logits: cross-entropy over them is the softmax over the choices.

Every handle (`embed_tokens`, `position_embeddings`, `movable`, `assemble`) works on the
flattened sequences, so MJP shuffles tokens inside each (context, ending) pair on its own, as it
does for a single sentence; [CLS] and both [SEP] never move.
"""

from __future__ import annotations

from torch import Tensor, nn

from veil.errors import VeilError
from veil.models.base import FEATURES, Batch, padding_bias, special_tokens_movable
from veil.models.text_encoder import TextEncoder, TextEncoderConfig

#: the batch keys that carry one row per choice
PER_CHOICE = ("input_ids", "attention_mask", "token_type_ids")


def flatten_choices(batch: Batch) -> Batch:
    """(B, C, T) per-choice tensors as (B * C, T); a (B, T) batch is refused in one line."""
    ids = batch["input_ids"]
    if ids.dim() != 3:
        raise VeilError(
            f"a multiple-choice model takes input_ids of shape (batch, choices, length), got {tuple(ids.shape)}; "
            "use data.name=mcqa"
        )
    return {k: (v.reshape(-1, v.shape[-1]) if k in PER_CHOICE else v) for k, v in batch.items()}


class MultipleChoiceEncoder(TextEncoder):
    """`TextEncoder` whose head scores each choice; ``num_classes`` is the number of choices."""

    def __init__(self, cfg: TextEncoderConfig) -> None:
        super().__init__(cfg)
        self.choices = cfg.num_classes
        self.head = nn.Linear(cfg.dim, 1)  # one score per (context, ending) pair

    def embed_tokens(self, batch: Batch) -> Tensor:
        return self.tok(flatten_choices(batch)["input_ids"])

    def movable(self, batch: Batch) -> Tensor:
        flat = flatten_choices(batch)
        return special_tokens_movable(flat["input_ids"], flat["attention_mask"], self.cfg.special_ids)

    def assemble(self, tok: Tensor, pos: Tensor, batch: Batch) -> Tensor:
        return super().assemble(tok, pos, flatten_choices(batch))

    def forward_from_embeddings(self, h: Tensor, batch: Batch) -> Tensor:
        flat = flatten_choices(batch)
        bias = padding_bias(flat["attention_mask"], causal=False, dtype=h.dtype)
        for blk in self.blocks:
            h = blk(h, bias)
        return self.head(h[:, 0]).view(batch["input_ids"].shape[0], batch["input_ids"].shape[1])

    def forward(self, batch: Batch) -> Tensor:
        if FEATURES in batch:
            raise VeilError("train.frozen_features is not supported by the multiple-choice model")
        if batch["input_ids"].dim() == 3 and batch["input_ids"].shape[1] != self.choices:
            raise VeilError(
                f"the model scores {self.choices} choices but the batch has {batch['input_ids'].shape[1]}; "
                "set data.choices to model.num_classes"
            )
        return super().forward(batch)


def _register() -> None:
    from veil.models import _preset  # the presets' builder (model.init, option checks)

    _preset(
        "transformer4-mc",
        MultipleChoiceEncoder,
        TextEncoderConfig,
        "transformer4 with a multiple-choice head: scores each (context, ending) pair, softmax over the choices",
        dim=96,
        depth=4,
        heads=4,
        num_classes=4,
    )


_register()
