"""The registered ``span`` attack (DAGER, Petrov et al. 2024): layer-1 candidates per position
(`veil.attacks.span.core`), then whole sentences: causal decoders by left-to-right extension and
encoders by the assignment search (`veil.attacks.span.search`), an encoder classifier given its
batch size by peeling one exact sentence at a time (`veil.attacks.span.peel`). The search is
bounded by counted work, never seconds: `budget` candidate sentences scored, and for the peeling
search also `work` block-rows computed (`veil.attacks.span.work`), the unit that tracks its time;
a search stopped by either returns its best and says so (``budget_stopped``, ``note``). A LoRA update
(adapters on the first layers' Q/K/V, the base frozen) is tested in the adapters' projected
spaces instead (`veil.attacks.span.lora`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from veil.attacks import ATTACKS
from veil.attacks.base import Attack, Knowledge, Observation, Reconstruction
from veil.attacks.span.core import (
    Span,
    Specials,
    apply_pins,
    layer_span,
    pin_positions,
    position_candidates,
    span_reads,
    vocabulary,
)
from veil.attacks.span.lora import lora_layers, lora_reconstruct
from veil.attacks.span.options import SpanOptions
from veil.attacks.span.peel import Residual, peel_search
from veil.attacks.span.search import SearchInput, decoder_search, encoder_search
from veil.errors import VeilError
from veil.models.base import VeilModel


@ATTACKS.register("span", help="DAGER-style exact text recovery from the span of the first layers' Q/K/V gradients")
class SpanAttack(Attack[SpanOptions]):
    """DAGER's span attack with veil's peeling search (options: `SpanOptions`)."""

    knows = "the first layers' Q/K/V gradients, the weights, the vocabulary and batch size; not the defense (naive)"
    modality = "text"
    observes = frozenset({"gradient", "delta"})
    needs_attention_layers = (2, "to resolve positions")
    dropout_breaks = ("tests tokens by exact span membership, which a client's dropout masks break", "span-robust")
    _batch = 1  # the batch size of the update last attacked: the block-row budget scales with it

    def budget(self) -> dict[str, int]:
        """Candidate sentences scored (decoders: prefixes), all searches together: every search
        checks it at every scoring call and cuts the call at what is left, so the work never passes
        it and a binding budget is spent exactly. And the block-rows the peeling search computes
        (`veil.attacks.span.work`), `work` per sentence of the batch last attacked (one before
        any): a call that would pass it is not made."""
        return {"sentences_scored": self.options.sentences(self._batch), "block_rows": self.options.work * self._batch}

    def reads(self, model: VeilModel) -> list[str]:
        """The first two attention layers' Q/K/V and the last one's Q, the token embedding (its
        bag) and the position table, and the down-projections the peeling search scores with."""
        return span_reads(model)

    def _reconstruct(self, obs: Observation, know: Knowledge) -> Reconstruction:
        if lora_layers(obs.model):  # a LoRA update: the span of the adapters' projected inputs
            return lora_reconstruct(self.options, obs, know)
        self._batch = max(1, know.batch_size or 1)
        first = _Layer1.spans(obs, know, self.options)
        model = obs.model
        was = model.training
        model.eval()
        try:
            with torch.no_grad():
                first.candidates_and_pins(obs, know, self.options)
                found = self._search(obs, know, first)
        finally:
            model.train(was)
        stats = {**first.stats(), "candidates_per_position": [len(c) for c in found.cands if len(c)], **found.info}
        stats.update(self._account(found))
        seqs = found.seqs or [[] for _ in range(know.batch_size or 1)]  # nothing passed: empty sentences, not none
        return Reconstruction(token_ids=seqs, token_set={int(v) for c in found.cands for v in c.tolist()}, stats=stats)

    def _search(self, obs: Observation, know: Knowledge, first: _Layer1) -> _Found:
        """Peeling where it applies (an encoder classifier given its batch size); where it ends with
        no exact sentence but budget left (e.g. the client shuffled its tokens), the budget left
        goes to the assignment search, which still rebuilds what layer 2 supports."""
        o, model = self.options, obs.model
        specials = Specials.of(model, know)
        budget, peeled = o.sentences(self._batch), 0
        if model.task != "lm" and o.peel and know.batch_size:
            found = self._peel(obs, know, first, specials)
            if found is not None:
                scored = found[1]["sentences_scored"]
                if found[1]["sentences_exact"] or budget - scored <= 0 or found[1]["work_stopped"]:
                    return _Found(found[0], {"search": "peel", **found[1]}, first.cands)
                budget, peeled = budget - scored, scored
        if model.task == "lm":
            search = SearchInput(model, first.span2, first.cands, specials, o.tol2, know.batch_size)
            seqs, info = decoder_search(search, beam=o.beam, per_sentence=o.beam_per_sentence, budget=budget)
            return _Found(seqs, info, first.cands, peeled)
        cands = first.pins[0] if first.pins is not None else first.cands  # encoders: the pins applied
        pins = first.pins[1] if first.pins else None
        search = SearchInput(model, first.span2, cands, specials, o.tol2, know.batch_size)
        seqs, info = encoder_search(search, o, seed=first.seed, pins=pins, budget=budget)
        return _Found(seqs, {"search": "assignment", **info}, cands, peeled)

    def _peel(
        self, obs: Observation, know: Knowledge, first: _Layer1, specials: Specials
    ) -> tuple[list[list[int]], dict[str, Any]] | None:
        """The peeling search (`veil.attacks.span.peel`) on the residual's layer-1 candidates, the
        LayerNorm pins applied; prefix seeds where the options say so or the pins cover enough."""
        o, pins = self.options, first.pins

        def pinned_candidates(span: Span) -> list[Tensor]:
            return apply_pins(first.candidates(obs.model, span, o), pins[1] if pins else {})

        seeds = _mostly_pinned(first.cands, pins, o.pinned_share) if o.prefix_seeds is None else o.prefix_seeds
        res = Residual(obs, know.batch_size or 1)
        return peel_search(obs, res, pinned_candidates, specials, o, seed=first.seed, seeds=seeds)

    def _account(self, found: _Found) -> dict[str, object]:
        """The work done in its units, whether a budget stopped the search, and a note saying so."""
        info, o = found.info, self.options
        scored = found.peeled + int(info.get("sentences_scored", info.get("prefixes_tested", 0)))
        work = {"sentences_scored": scored}
        if "block_rows" in info:  # the peeling search's second unit
            work["block_rows"] = int(info["block_rows"])
        spent = (("sentences_scored", scored >= o.sentences(self._batch)), ("block_rows", info.get("work_stopped")))
        stopped = [u for u, out in spent if out]
        out: dict[str, object] = {"work": work, "budget_stopped": bool(stopped)}
        if stopped:
            out["note"] = (
                f"stopped at budget ({', '.join(stopped)}): the exact sentences found, best guesses for the rest"
            )
        return out


@dataclass
class _Layer1:
    """What every search starts from: the first two layers' spans, the longest sentence searched,
    the searches' seed, and (`candidates_and_pins`) each position's layer-1 candidates, the
    presence filter's bag and the encoder's embedding-LayerNorm pins."""

    span1: Span
    span2: Span
    max_len: int
    seed: int
    vocab: Tensor | None = None
    cands: list[Tensor] = field(default_factory=list)
    pins: tuple[list[Tensor], dict[int, int]] | None = None

    @classmethod
    def spans(cls, obs: Observation, know: Knowledge, o: SpanOptions) -> _Layer1:
        span1, span2 = layer_span(obs, 0, o.rank_tol), layer_span(obs, 1, o.rank_tol)
        limit = obs.model.position_table().reshape(-1, span1.width).shape[0]
        max_len = int(o.max_len or know.seq_len or limit)
        if max_len > limit:
            raise VeilError(f"span: max_len {max_len} exceeds the model's {limit} positions")
        return cls(span1, span2, max_len, know.seed if o.seed is None else o.seed)

    def candidates(self, model: VeilModel, span: Span, o: SpanOptions) -> list[Tensor]:
        """Each position's tokens whose layer input lies within `tol1` of `span`."""
        cap = o.max_per_position or None
        return position_candidates(model, span, self.max_len, o.tol1, vocab=self.vocab, max_per_position=cap)[0]

    def candidates_and_pins(self, obs: Observation, know: Knowledge, o: SpanOptions) -> None:
        self.vocab = vocabulary(obs, know, o.presence_tol) if o.presence_filter else None
        self.cands = self.candidates(obs.model, self.span1, o)
        if obs.model.task != "lm" and o.layernorm_positions:  # encoders: both searches read the pins
            self.pins = pin_positions(obs, self.cands, o.tol_ln, o.ln_slack)

    def stats(self) -> dict[str, object]:
        width = self.span1.width
        return {
            "rank1": self.span1.rank,
            "rank2": self.span2.rank,
            "width": width,
            "full_rank": self.span1.rank >= width,
            "layernorm_pins": len(self.pins[1]) if self.pins else 0,
            "vocabulary": len(self.vocab) if self.vocab is not None else "all",
        }


@dataclass
class _Found:
    """A search's sentences and stats, the candidates it searched, and the sentences scored by an
    earlier search whose budget it continued (peeling that found no exact sentence)."""

    seqs: list[list[int]]
    info: dict[str, Any]
    cands: list[Tensor]
    peeled: int = 0


def _mostly_pinned(cands: list[Tensor], pins: tuple[list[Tensor], dict[int, int]] | None, share: float) -> bool:
    """Whether the embedding LayerNorm pins at least `share` of the tokens layer 1 admits: the prefix
    seeds' greedy growth then picks among a few tokens per position; where few tokens are pinned
    (an encoder at init) the seeds would spend the budget the walkers solve in."""
    if not pins:  # pin_positions gives None when no position has a candidate
        return False
    return len(pins[1]) >= share * len(torch.unique(torch.cat([c for c in cands if len(c)])))
