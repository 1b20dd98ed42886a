"""The registered ``span-down`` attack: DAGER's span test (Petrov et al. 2024, eq. 2-3) on the MLP
down-projections' gradients, with no candidate pool. The searches are in
`veil.attacks.span.down_search`.

A defense that freezes the attention projections (AEGIS's channel 1) and noises the embedding and
the MLP expansion (channels 2, 3) still exports every block's down-projection (fc2 / c_proj / w2)
in the clear unless it noises that too: its gradient ``sum_i delta_i a_i^T`` spans the blocks' MLP
activations ``a_i``, which the server recomputes for any candidate sentence with the weights it
sent. The attack reads what the update exports in the clear, chosen from the update itself:

* every exported down-projection: block 1's scores candidate tokens position by position, all of
  them together score whole sentences (encoders' re-ranking);
* the position table's gradient: a sentence's length (its last non-zero row; at batch > 1 the
  longest sentence not yet peeled);
* a causal LM's head: its largest gradient rows are the batch's target tokens (the candidates of
  the prefix search, instead of the whole vocabulary) and, once the rest of a sentence is known,
  its last token.

A tensor the knowledge says is noised (`veil.attacks.adaptive.noised_channel`) is read as its top
singular directions, as many as tokens are known to have a gradient (the span the signal would
have): the adaptive reading; a noised or tied head gives no candidates (the whole vocabulary is
tested) and the last token is the tokenizer's [SEP] where it has one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from veil.attacks import ATTACKS
from veil.attacks.adaptive import noised_channel
from veil.attacks.base import Attack, Knowledge, Observation, Reconstruction
from veil.attacks.options import Options, option
from veil.attacks.span.checks import row_span
from veil.attacks.span.core import Span, param_name
from veil.attacks.span.down_search import (
    RowScorer,
    activation_rank,
    coordinate_descent,
    head_rows,
    last_nonzero_row,
    last_tokens,
    peel_grads,
    prefix_search,
    weight_grad,
)
from veil.errors import VeilError
from veil.models.base import VeilModel


@dataclass(frozen=True)
class SpanDownOptions(Options):
    tol: float = option(0.01, "decoders: a grown prefix's new row passes below this distance to the span")
    head_candidates: int = option(2048, "decoders: the clean LM head gradient's largest rows tested (else all)")
    beam: int | None = option(None, "decoders: prefixes kept per position; unset: beam_per_sentence x batch size")
    beam_per_sentence: int = option(4, "decoders: the default beam's prefixes per sentence of the batch")
    sweeps: int = option(4, "encoders: coordinate-descent sweeps per sentence")
    shortlist: int = option(8, "encoders: a position's best tokens by their own row, re-ranked by the sentence")
    narrow: int = option(
        256, "encoders: sweeps after the wide ones score only a position's best tokens of the last wide sweep (0: all)"
    )
    wide_sweeps: int = option(2, "encoders: the first sweeps, which score the whole vocabulary at every position")
    budget: int = option(
        5_000_000, "candidate sentences scored at one position, all searches together (counted work, never seconds)"
    )


#: singular values of the residual down-projection gradient below this x the largest are float
#: rounding, not rank (the peeling's label choice counts the rank a sentence removes)
RANK_TOL = 1e-6


def down_modules(model: VeilModel) -> list[nn.Module]:
    """Every block's MLP down-projection (a gated MLP's one output projection)."""
    out = []
    for m in model.mlp_down():
        out += m if isinstance(m, list | tuple) else [m]
    return out


def lm_head(model: VeilModel) -> nn.Module | None:
    """A causal LM's head (tied or not), else None."""
    return model.classifier() if model.task == "lm" and hasattr(model.classifier(), "weight") else None


@ATTACKS.register(
    "span-down",
    help="pool-free span attack on the clean MLP down-projection gradients (+ position table, LM head)",
)
class SpanDownAttack(Attack[SpanDownOptions]):
    """Pool-free span attack on the down-projections (options: `SpanDownOptions`)."""

    knows = "which exported tensors are noised (Knowledge.defense), the weights, the vocabulary and batch size"
    modality = "text"
    observes = frozenset({"gradient", "delta"})
    #: where it applies beside the modality (`Attack.applies`): a client's dropout masks move the
    #: activations off the span its exact test reads
    dropout_breaks = ("tests tokens by exact span membership, which a client's dropout masks break", "span-robust")

    def budget(self) -> dict[str, int]:
        return {"sentences_scored": self.options.budget}

    def reads(self, model: VeilModel) -> list[str]:
        """The parameters whose exported gradient the attack reads."""
        used = [m.weight for m in down_modules(model)]
        if model.absolute_positions:
            used.append(model.position_table())
        head = lm_head(model)
        if head is not None:
            used.append(head.weight)
        return [param_name(model, p) for p in used]

    def _reconstruct(self, obs: Observation, know: Knowledge) -> Reconstruction:
        model = obs.model
        downs = [m for m in down_modules(model) if obs.has_grad(m)]
        if not downs:
            obs.grad(down_modules(model)[0])  # the one-line refusal naming the missing gradient
        B = know.batch_size or 1
        T = know.seq_len or model.max_positions()
        noised = noised_channel(know.defense, "mlp_down")
        k = B * T if noised else None
        spans = [(m, row_span(weight_grad(obs, m).double(), k=k)) for m in downs]
        self._k = k
        was = model.training
        model.eval()
        try:
            search = self._decoder if model.causal else self._encoder
            rec = search(obs, know, spans, B, T)
        finally:
            model.train(was)
        rec.stats.update(
            {
                "read": [param_name(model, m.weight) for m in downs],
                "ranks": [sp.rank for _, sp in spans],
                "noised": noised,
            }
        )
        return rec

    # ---- causal decoders: prefix search on block 1, last token from the head ---------------------
    def _decoder(
        self, obs: Observation, know: Knowledge, spans: list[tuple[nn.Module, Span]], B: int, T: int
    ) -> Reconstruction:
        model, o = obs.model, self.options
        head = lm_head(model)
        tied = head is not None and head.weight is model.token_embedding().weight
        clean_head = (
            head is not None
            and obs.has_grad(head)
            and not noised_channel(know.defense, "head")
            and not (tied and noised_channel(know.defense, "embedding"))
        )
        hg = weight_grad(obs, head) if clean_head and head is not None else None
        cands = head_rows(model, hg, o.head_candidates)
        vocab = torch.arange(model.token_embedding().weight.shape[0])
        scorer = RowScorer(model, spans[0][0], spans[0][1], o.budget)
        found = prefix_search(scorer, vocab, cands, T, o.tol, o.beam or o.beam_per_sentence * B)
        # the most independent rows first (a repeated token's run passes with rank 1), then the closest
        ranks = [activation_rank(model, spans[0][0], p) for p, _ in found]
        found = [f for _, f in sorted(zip(ranks, found), key=lambda rf: (-rf[0], rf[1][1]))]
        prefixes = [p for p, _ in found[:B]]
        sep = getattr(know.tokenizer, "sep_id", None)
        if prefixes and hg is not None and head is not None:
            lasts = last_tokens(model, head, hg, prefixes, placeholder=_placeholder(know, cands))
        else:
            lasts = [int(sep) if sep is not None else int(cands[0])] * len(prefixes)
        sentences = [[*p, v] for p, v in zip(prefixes, lasts)]
        if not sentences:  # no first token lies in the span (a noised down-projection): the frame alone
            cls = getattr(know.tokenizer, "cls_id", None)
            sentences = [[int(cls) if cls is not None else int(vocab[0]), int(sep) if sep is not None else 0]] * B
        stats = {
            "work": {"sentences_scored": scorer.scored},
            "budget_stopped": scorer.stopped,
            "scoring": scorer.mode,
            "candidates": len(cands),
            "head_clean": hg is not None,
            "distances": [d for _, d in found[:B]],
        }
        return Reconstruction(token_ids=sentences, stats=stats)

    # ---- encoders: coordinate descent per sentence, peeling at batch > 1 ------------------------
    def _encoder(
        self, obs: Observation, know: Knowledge, spans: list[tuple[nn.Module, Span]], B: int, T: int
    ) -> Reconstruction:
        model, o = obs.model, self.options
        tok = know.tokenizer
        cls, sep = getattr(tok, "cls_id", None), getattr(tok, "sep_id", None)
        filler = getattr(tok, "mask_id", None) or getattr(tok, "unk_id", None) or 0
        pos_name = param_name(model, model.position_table()) if model.absolute_positions else None
        names = [param_name(model, m.weight) for m, _ in spans] + ([pos_name] if pos_name in obs.grads else [])
        resid = {n: obs.grads[n].detach().double().clone() for n in names}
        pos_scale = float(resid[pos_name].norm()) if pos_name in resid else 0.0
        labels = int(getattr(model.classifier(), "out_features", 2))
        scorer = RowScorer(model, spans[0][0], spans[0][1], o.budget)
        k = self._k
        sentences, costs, lengths = [], [], []
        for b in range(B):
            L = last_nonzero_row(resid[pos_name], pos_scale) if pos_name in resid else T
            if L < 2 or scorer.stopped:
                break
            if b:  # the spans of what is left
                spans = [(m, row_span(_as_weight(m, resid[n]), k=k)) for (m, _), n in zip(spans, names)]
                scorer.basis = spans[0][1].basis.float().to(scorer.basis.device)
            fixed = {t: v for t, v in ((0, cls), (L - 1, sep)) if v is not None}
            ids, cost = coordinate_descent(model, spans, L, fixed, int(filler), scorer, o)
            sentences.append(ids)
            costs.append(cost)
            lengths.append(L)
            if b + 1 < B:
                _peel(model, resid, names, ids, labels, B, spans[0][0], names[0])
        stats = {
            "work": {"sentences_scored": scorer.scored},
            "budget_stopped": scorer.stopped,
            "scoring": scorer.mode,
            "lengths": lengths,
            "distances": costs,
        }
        return Reconstruction(token_ids=sentences, stats=stats)


def _as_weight(module: nn.Module, g: Tensor) -> Tensor:
    from veil.models.base import linear_weight

    return linear_weight(module, g)


def _peel(
    model: VeilModel,
    resid: dict[str, Tensor],
    names: list[str],
    ids: list[int],
    labels: int,
    B: int,
    down: nn.Module,
    name: str,
) -> None:
    """Subtract sentence `ids`'s gradient (/ B) with the label whose subtraction drops the first
    down-projection's residual rank by the sentence's length: the least energy left beyond it."""
    before = torch.linalg.svdvals(_as_weight(down, resid[name]))
    r0 = int((before > RANK_TOL * before[0]).sum()) if len(before) and before[0] > 0 else 0
    keep = max(0, r0 - len(ids))
    best: tuple[float, dict[str, Tensor]] | None = None
    for g in peel_grads(model, names, ids, labels, B):
        sv = torch.linalg.svdvals(_as_weight(down, resid[name] - g[name].reshape(resid[name].shape)))
        score = float(sv[keep:].sum() / sv.sum().clamp_min(1e-300))
        if best is None or score < best[0]:
            best = (score, g)
    assert best is not None
    for n in names:
        resid[n] -= best[1][n].reshape(resid[n].shape)


def _placeholder(know: Knowledge, cands: Tensor) -> int:
    pad = getattr(know.tokenizer, "pad_id", None)
    if pad is not None:
        return int(pad)
    raise VeilError("span-down needs the tokenizer's pad id as the last-token placeholder")
