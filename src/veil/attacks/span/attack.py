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
        model, o = obs.model, self.options
        self._batch = max(1, know.batch_size or 1)
        tol1, tol2, rank_tol = o.tol1, o.tol2, o.rank_tol
        span1, span2 = layer_span(obs, 0, rank_tol), layer_span(obs, 1, rank_tol)
        width = span1.width
        limit = model.position_table().reshape(-1, width).shape[0]
        max_len = int(o.max_len or know.seq_len or limit)
        if max_len > limit:
            raise VeilError(f"span: max_len {max_len} exceeds the model's {limit} positions")
        cap = o.max_per_position
        seed = know.seed if o.seed is None else o.seed
        was = model.training
        model.eval()
        pins = None
        try:
            with torch.no_grad():
                vocab = vocabulary(obs, know) if o.presence_filter else None

                def candidates(span: Span) -> list[Tensor]:
                    return position_candidates(model, span, max_len, tol1, vocab=vocab, max_per_position=cap or None)[0]

                cands = candidates(span1)
                specials = Specials.of(model, know)
                found, budget, peeled = None, o.sentences(self._batch), 0
                if model.task != "lm" and o.layernorm_positions:  # encoders: both searches read the pins
                    pins = pin_positions(obs, cands, o.tol_ln)
                if model.task != "lm" and o.peel and know.batch_size:

                    def pinned_candidates(span: Span) -> list[Tensor]:
                        return apply_pins(candidates(span), pins[1] if pins else {})

                    found = peel_search(
                        obs,
                        Residual(obs, know.batch_size),
                        pinned_candidates,
                        specials,
                        o,
                        seed=seed,
                        seeds=_mostly_pinned(cands, pins) if o.prefix_seeds is None else o.prefix_seeds,
                    )
                    left = budget - (found[1]["sentences_scored"] if found is not None else 0)
                    if (
                        found is not None
                        and not found[1]["sentences_exact"]
                        and left > 0
                        and not found[1]["work_stopped"]
                    ):
                        # no sentence passed the exact [CLS] check (e.g. the client shuffled its tokens):
                        # the assignment search below still rebuilds what layer 2 supports, in the budget left
                        budget, found, peeled = left, None, found[1]["sentences_scored"]
                if found is not None:
                    seqs, info = found
                    info = {"search": "peel", **info}
                elif model.task == "lm":
                    search = SearchInput(model, span2, cands, specials, tol2, know.batch_size)
                    seqs, info = decoder_search(search, beam=o.beam, budget=budget)
                else:
                    cands = pins[0] if pins is not None else cands
                    seqs, info = encoder_search(
                        SearchInput(model, span2, cands, specials, tol2, know.batch_size),
                        seed=seed,
                        restarts=o.restarts,
                        sweeps=o.sweeps,
                        pins=pins[1] if pins else None,
                        budget=budget,
                    )
                    info = {"search": "assignment", **info}
        finally:
            model.train(was)
        stats = {
            "rank1": span1.rank,
            "rank2": span2.rank,
            "width": width,
            "full_rank": span1.rank >= width,
            "layernorm_pins": len(pins[1]) if pins else 0,
            "vocabulary": len(vocab) if vocab is not None else "all",
            "candidates_per_position": [len(c) for c in cands if len(c)],
            **info,
        }
        scored = peeled + int(info.get("sentences_scored", info.get("prefixes_tested", 0)))
        work = {"sentences_scored": scored}
        if "block_rows" in info:  # the peeling search's second unit
            work["block_rows"] = int(info["block_rows"])
        stopped = [
            u
            for u, spent in (
                ("sentences_scored", scored >= o.sentences(self._batch)),
                ("block_rows", info.get("work_stopped")),
            )
            if spent
        ]
        stats.update(work=work, budget_stopped=bool(stopped))
        if stopped:
            stats["note"] = (
                f"stopped at budget ({', '.join(stopped)}): the exact sentences found, best guesses for the rest"
            )
        if not seqs:  # nothing passed: say so with empty sentences rather than an empty batch
            seqs = [[] for _ in range(know.batch_size or 1)]
        return Reconstruction(token_ids=seqs, token_set={int(v) for c in cands for v in c.tolist()}, stats=stats)


def _mostly_pinned(cands: list[Tensor], pins: tuple[list[Tensor], dict[int, int]] | None) -> bool:
    """Whether the embedding LayerNorm pins at least half of the tokens layer 1 admits: the prefix
    seeds' greedy growth then picks among a few tokens per position; where few tokens are pinned
    (an encoder at init) the seeds would spend the budget the walkers solve in."""
    if not pins:  # pin_positions gives None when no position has a candidate
        return False
    return len(pins[1]) >= 0.5 * len(torch.unique(torch.cat([c for c in cands if len(c)])))
