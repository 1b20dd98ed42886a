"""Token presence from the token-embedding gradient (the bag-of-words leak used by LAMP,
Balunovic et al. 2022, sec. 4, and by DAGER, Petrov et al. 2024, as a vocabulary filter).

An embedding lookup ``e_i = E[x_i]`` backpropagates ``dL/dE = sum_i onehot(x_i) (dL/de_i)^T``:
row ``v`` of the token-embedding gradient is non-zero only if token ``v`` occurs in the batch
(and its position influenced the loss). So the set of rows whose norm exceeds a threshold,

    S = { v : ||dL/dE[v]||_2 > max(rel_tol * max_u ||dL/dE[u]||_2, abs_tol) },

is the batch's bag of tokens. Untouched rows are exact zeros, so a tiny relative threshold
separates them; additive noise (DP) makes every row non-zero and precision collapses.

Special tokens: padding positions are masked out as attention keys and (LM) as targets, so
[PAD] usually gets no gradient; [SEP] gets none in a causal LM (its output is not scored).
[CLS]/[SEP]/[PAD] occur in every sentence and tell nothing, so by default they are dropped from
the returned set (``keep_special=False``); score against `true_token_set` with the same choice.
A model whose LM head is tied to the token embedding (GPT-2) puts gradient on every row; the
attack refuses it rather than return the whole vocabulary.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from veil.attacks import ATTACKS
from veil.attacks.base import Attack, Knowledge, Observation, Reconstruction, param_names
from veil.attacks.options import Options, option
from veil.errors import VeilError
from veil.models.base import VeilModel


def special_ids(model: VeilModel, tokenizer: Any = None) -> list[int]:
    """The special token ids the attacker knows: from the tokenizer, else the model's config."""
    if tokenizer is not None:
        ids = [getattr(tokenizer, a, None) for a in ("pad_id", "cls_id", "sep_id")]
        return [int(i) for i in ids if i is not None]
    for owner in (model, getattr(model, "cfg", None)):
        ids = getattr(owner, "special_ids", None)
        if ids:
            return list(ids)
    pad = getattr(getattr(model, "cfg", None), "pad_id", getattr(model, "pad_id", None))
    return [0, 101, 102] if pad is None else [pad, 101, 102]


def token_bag(found: set[int], obs: Observation, know: Knowledge, keep: bool, **stats: Any) -> Reconstruction:
    """A presence attack's result: the bag `found`, less the special tokens unless `keep`, with its
    size (``found``) first in the stats."""
    if not keep:
        found = found - set(special_ids(obs.model, know.tokenizer))
    return Reconstruction(token_set=found, stats={"found": len(found), **stats})


def true_token_set(input_ids: Tensor, attention_mask: Tensor | None, drop: Iterable[int] = ()) -> set[int]:
    """The bag of tokens of a batch (real positions only), without the ids in `drop`."""
    ids = input_ids if attention_mask is None else input_ids[attention_mask.bool()]
    return set(int(i) for i in ids.flatten().tolist()) - set(drop)


def embedding_row_norms(obs: Observation) -> Tensor:
    """Row norms of the token-embedding gradient; one-line error if it was not exported or is tied."""
    model = obs.model
    emb = model.token_embedding()
    head = model.classifier()
    if getattr(head, "weight", None) is emb.weight:
        raise VeilError(
            "presence needs an untied token embedding; this model ties it to the LM head, so every row gets gradient"
        )
    if not emb.weight.requires_grad and not obs.has_grad(emb):
        raise VeilError(frozen_embedding_reason("presence"))
    g = obs.grad(emb)
    if g.dim() != 2:
        raise VeilError(f"presence needs a token-embedding table gradient (vocab, width), got shape {tuple(g.shape)}")
    return g.float().norm(dim=1)


def frozen_embedding_reason(attack: str) -> str:
    """Why an attack on the token-embedding gradient does not apply where the embedding is frozen."""
    return (
        f"{attack} is not applicable: the token embedding does not train here (frozen, e.g. under train.lora only "
        "the adapters train), so the update holds no gradient of it"
    )


def present_tokens(norms: Tensor, rel_tol: float = 1e-6, abs_tol: float = 0.0) -> Tensor:
    """Ids of the rows above the threshold (vectorised; see the module docstring)."""
    top = float(norms.max()) if norms.numel() else 0.0
    if top <= 0.0:
        return torch.zeros(0, dtype=torch.long)
    return torch.nonzero(norms > max(rel_tol * top, abs_tol)).flatten()


@dataclass(frozen=True)
class PresenceOptions(Options):
    rel_tol: float = option(1e-6, "a row is present when its norm exceeds rel_tol x the largest row norm")
    abs_tol: float = option(0.0, "and exceeds this absolute norm")
    keep_special: bool = option(False, "keep the special tokens ([CLS], [SEP], padding) in the bag")


class ReadsEmbeddingRows:
    """Where an attack on the token-embedding rows applies (an untied, trained table), what it
    observes and what it reads."""

    name: str
    modality = "text"
    observes = frozenset({"gradient", "delta"})
    closed_form = "one pass over the embedding rows"
    needs_untied_embedding = True

    def applies_to(self, model: VeilModel) -> str | None:
        reason = super().applies_to(model)  # type: ignore[misc]
        if reason is None and not model.token_embedding().weight.requires_grad:
            return frozen_embedding_reason(self.name)
        return reason

    def reads(self, model: VeilModel) -> list[str]:
        """The token-embedding gradient's (or update's) rows."""
        return param_names(model, [model.token_embedding()])


@ATTACKS.register("presence", help="token bag from the row norms of the token-embedding gradient (text)")
class PresenceAttack(ReadsEmbeddingRows, Attack[PresenceOptions]):
    """Token bag from the embedding gradient's row norms (options: `PresenceOptions`)."""

    knows = "the token-embedding gradient and the public vocabulary; not the defense (naive)"

    def _reconstruct(self, obs: Observation, know: Knowledge) -> Reconstruction:
        rel_tol, abs_tol = self.options.rel_tol, self.options.abs_tol
        norms = embedding_row_norms(obs)
        found = set(present_tokens(norms, rel_tol, abs_tol).tolist())
        keep = self.options.keep_special
        return token_bag(found, obs, know, keep, rel_tol=rel_tol, keep_special=keep)
