"""The searches of ``span-down`` (`veil.attacks.span.down`): DAGER's span test (Petrov et al. 2024,
eq. 2-3) on the MLP down-projections' gradients, with no candidate pool.

A block's down-projection ``y_i = W a_i`` gets ``dL/dW = sum_i delta_i a_i^T`` over every token i
with a gradient, so its row space is ``span{a_i}`` below its rank limit; ``a_i`` (the block's MLP
activation) is a function of the tokens the server computes with the model's weights for any
candidate sentence. Each candidate position is scored by the relative distance of its ``a_t`` to
that row space (`_distance`), one vectorised pass per chunk of candidates through the first block
only (`veil.attacks.span.rowwise`: block 1's MLP computes the scored row alone).

Causal decoders (`prefix_search`): ``a_t`` depends on tokens <= t only, so sentences grow left to
right (DAGER alg. 1): every candidate token is appended to every kept prefix and the pairs whose
new row lies in the span (distance < tol) are kept. A sentence's last token gets no gradient at
its own position (it has no target); the LM head's gradient holds it: row v of ``dL/dW_head`` is
``(1/N) sum_t (p_tv - 1[x_{t+1} = v]) h_t``, so once the rest is known the residual of the head
gradient after the recomputed one (with a placeholder last token) is ``-(1/N) h_{T-2}`` at the
last token's row (`last_tokens`).

Bidirectional encoders (`coordinate_descent`): every ``a_t`` reads the whole sentence, so a
sentence of known length is found by coordinate descent: each sweep scores every vocabulary token
at each position by that position's distance, re-ranks the `shortlist` best by the whole
sentence's mean distance over every clean down-projection, and keeps the best. At batch > 1 the
found sentence's own gradient (its best label) is subtracted from the observation (peeling,
`Residual` of `veil.attacks.span.residual`'s rule) and the next length read off the residual
position-table gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import Tensor, nn

from veil.attacks.base import Observation
from veil.attacks.span.core import Span, model_device, recording_inputs
from veil.attacks.span.down_rows import MODES, row_activation
from veil.models.base import VeilModel, linear_weight

#: candidate sentences per scoring call: a bound on one call's memory, not a tunable of the search
CHUNK = 2048
#: a row of the position-table gradient is zero (no token there) below this x the table's norm:
#: float rounding of a real row's gradient is far above it, not a tunable of the search
ZERO_ROW = 1e-4
#: singular values below this x the largest are rounding of a prefix's activations, not rank
RANK_REL = 1e-3
#: the scoring modes agree with the full pass within float32 rounding of the block's activations
AGREE = 1e-4


def _distance(x: Tensor, basis: Tensor) -> Tensor:
    """Relative distance of each row of `x` to the span of the orthonormal `basis` (float32)."""
    r = (x @ basis).pow(2).sum(-1) / x.pow(2).sum(-1).clamp_min(1e-30)
    return (1 - r).clamp_min(0).sqrt()


class RowScorer:
    """Distances of one position's first-block MLP activation to the first down-projection's span,
    for sentences that differ only in that position (`veil.attacks.span.down_rows`); the first
    call checks each scoring mode against the full forward pass and keeps the fastest that agrees.
    It scores at most `limit` candidates in all (the attack's budget): past it, +inf and ``stopped``."""

    def __init__(self, model: VeilModel, down: nn.Module, span: Span, limit: int) -> None:
        self.model, self.down = model, down
        self.basis = span.basis.float().to(model_device(model))
        self.mode: str | None = None
        self.sure = False  # checked on sentences of two tokens or more (RoPE leaves one token unrotated)
        self.scored, self.limit, self.stopped = 0, limit, False

    def __call__(self, ids: Tensor, t: int) -> Tensor:
        left = max(0, self.limit - self.scored)
        if left < len(ids):
            self.stopped = True
        out = [torch.full((max(0, len(ids) - left),), torch.inf)]
        for s in range(0, min(left, len(ids)), CHUNK):
            part = ids[s : min(s + CHUNK, left)]
            if self.mode is None or not self.sure:
                a, self.sure = self._pick(part, t), part.shape[1] > 1
            else:
                a = row_activation(self.model, part, t, self.down, self.mode)
            out.insert(-1, _distance(a[:, 0] if a.shape[1] == 1 else a[:, t], self.basis).cpu())
            self.scored += len(part)
        return torch.cat(out)

    def _pick(self, ids: Tensor, t: int) -> Tensor:
        """The full pass's rows for `ids`, and the first mode that reproduces them as ``mode``."""
        plain = row_activation(self.model, ids, t, self.down, "plain")
        want = plain[:, 0] if plain.shape[1] == 1 else plain[:, t]
        for mode in MODES[:-1]:
            try:
                a = row_activation(self.model, ids, t, self.down, mode)
            except (RuntimeError, ValueError, TypeError, ZeroDivisionError, IndexError):
                continue
            got = a[:, 0] if a.shape[1] == 1 else a[:, t]
            if got.shape == want.shape and bool(torch.allclose(got, want, atol=AGREE, rtol=AGREE)):
                self.mode = mode
                return plain
        self.mode = "plain"
        return plain


def sentence_costs(model: VeilModel, spans: list[tuple[nn.Module, Span]], ids: Tensor) -> Tensor:
    """Mean over positions and the given down-projections of each sentence's distance, (N,)."""
    mods = [m for m, _ in spans]
    bases = [sp.basis.float().to(model_device(model)) for _, sp in spans]
    out = []
    for s in range(0, len(ids), CHUNK):
        part = ids[s : s + CHUNK].to(model_device(model))
        with torch.no_grad(), recording_inputs(mods, stop=mods[-1]) as seen:
            model({"input_ids": part, "attention_mask": torch.ones_like(part)})
        out.append(sum(_distance(seen[id(m)], b).mean(-1) for m, b in zip(mods, bases)).cpu() / len(mods))
    return torch.cat(out)


# ----------------------------------------------------------------------------- encoders
class Descent(Protocol):
    """The coordinate descent's settings (`SpanDownOptions` holds them)."""

    sweeps: int
    shortlist: int
    narrow: int
    wide_sweeps: int


def coordinate_descent(
    model: VeilModel,
    spans: list[tuple[nn.Module, Span]],
    length: int,
    fixed: dict[int, int],
    filler: int,
    scorer: RowScorer,
    o: Descent,
) -> tuple[list[int], float]:
    """The sentence of `length` tokens (those in `fixed` known) whose activations sit closest to
    the spans, by coordinate descent (module docstring); returns it and its mean distance. The
    first ``o.wide_sweeps`` sweeps score the whole vocabulary at each position; with ``o.narrow``,
    the later ones only the ``o.narrow`` tokens the last of those ranked best there. It stops at
    a sweep that changes nothing (the second at the earliest: the first starts from filler)."""
    vocab = model.token_embedding().weight.shape[0]
    ids = torch.full((length,), filler, dtype=torch.long)
    for t, v in fixed.items():
        ids[t] = v
    free = [t for t in range(length) if t not in fixed]
    cost = float(sentence_costs(model, spans, ids[None])[0])
    ranked: dict[int, Tensor] = {}
    wide = max(1, o.wide_sweeps)  # the narrowed sweeps need a wide one's ranking
    for sweep in range(o.sweeps):
        changed = False
        rank_into = ranked if o.narrow and sweep == wide - 1 else None
        for t in free:
            if scorer.stopped:
                break
            pool = ranked[t] if o.narrow and sweep >= wide else torch.arange(vocab)
            best, best_cost = _best_at(model, spans, ids, t, pool, scorer, o, rank_into)
            if best != int(ids[t]) and best_cost < cost:
                ids[t], cost, changed = best, best_cost, True
        if not changed and sweep >= 1:
            break
    return ids.tolist(), cost


def _best_at(
    model: VeilModel,
    spans: list[tuple[nn.Module, Span]],
    ids: Tensor,
    t: int,
    pool: Tensor,
    scorer: RowScorer,
    o: Descent,
    rank_into: dict[int, Tensor] | None,
) -> tuple[int, float]:
    """The token of `pool` at position t whose sentence costs least, and that cost: every token
    scored by its own row (`scorer`), the ``o.shortlist`` best re-ranked by the whole sentence
    (`sentence_costs`). With `rank_into`, position t's ``o.narrow`` best by their own row go there."""
    cand = ids.expand(len(pool), len(ids)).clone()
    cand[:, t] = pool
    own = scorer(cand, t)
    if rank_into is not None:
        rank_into[t] = pool[own.topk(min(o.narrow, len(pool)), largest=False).indices]
    top = own.topk(min(o.shortlist, len(pool)), largest=False).indices
    full = sentence_costs(model, spans, cand[top])
    return int(pool[top[int(full.argmin())]]), float(full.min())


def peel_grads(model: VeilModel, names: list[str], ids: list[int], labels: int, batch: int) -> list[dict[str, Tensor]]:
    """Each label's gradient of sentence `ids` alone, / batch (the client's mean), for `names`."""
    params = dict(model.named_parameters())
    dev = model_device(model)
    x = torch.tensor([ids], device=dev)
    out = []
    for y in range(labels):
        b = {"input_ids": x, "attention_mask": torch.ones_like(x), "labels": torch.tensor([y], device=dev)}
        with torch.enable_grad():
            g = torch.autograd.grad(model.loss(model(b), b), [params[n] for n in names], allow_unused=True)
        out.append({n: (gi.double() / batch if gi is not None else torch.zeros(1)) for n, gi in zip(names, g)})
    return out


def last_nonzero_row(g: Tensor, scale: float, rel: float = ZERO_ROW) -> int:
    """1 + the last row of `g` (rows, width) whose norm is above rel x scale (0 if none)."""
    rows = torch.nonzero(g.reshape(g.shape[0], -1).norm(dim=1) > rel * scale).flatten()
    return int(rows[-1]) + 1 if len(rows) else 0


# ----------------------------------------------------------------------------- decoders
def prefix_search(
    scorer: RowScorer,
    first: Tensor,
    cands: Tensor,
    max_len: int,
    tol: float,
    beam: int,
) -> list[tuple[list[int], float]]:
    """Sentences (without their last token) grown left to right (module docstring), with their mean
    distance: the prefixes that no candidate extends, or that reach ``max_len - 1`` tokens."""
    d0 = scorer(first[:, None], 0)
    keep = torch.nonzero(d0 < tol).flatten()
    keep = keep[d0[keep].argsort()][:beam]
    live = [([int(first[i])], float(d0[i])) for i in keep]
    done: list[tuple[list[int], float]] = []
    while live and not scorer.stopped:
        grown: list[tuple[list[int], float]] = []
        for prefix, total in live:
            if len(prefix) >= max_len - 1:
                done.append((prefix, total / len(prefix)))
                continue
            ids = torch.cat([torch.tensor(prefix).expand(len(cands), -1), cands[:, None]], dim=1)
            d = scorer(ids, len(prefix))
            ok = torch.nonzero(d < tol).flatten()
            if not len(ok):
                done.append((prefix, total / len(prefix)))
            grown += [([*prefix, int(cands[i])], total + float(d[i])) for i in ok]
        live = sorted(grown, key=lambda pt: pt[1] / len(pt[0]))[:beam]
    return sorted(done, key=lambda pt: pt[1])


def activation_rank(model: VeilModel, down: nn.Module, prefix: list[int], rel: float = RANK_REL) -> int:
    """The rank of a prefix's activations at `down`: a true sentence's rows are independent, while
    a run of one repeated token (RoPE: every row the same) passes the span test with rank 1."""
    ids = torch.tensor([prefix], device=model_device(model))
    with torch.no_grad(), recording_inputs([down], stop=down) as seen:
        model({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    sv = torch.linalg.svdvals(seen[id(down)][0].double())
    return int((sv > rel * sv[0]).sum()) if len(sv) and sv[0] > 0 else 0


def head_rows(model: VeilModel, head_grad: Tensor | None, k: int) -> Tensor:
    """The k largest rows of the (clean) LM-head gradient (its targets), or the whole vocabulary."""
    vocab = model.token_embedding().weight.shape[0]
    if head_grad is None:
        return torch.arange(vocab)
    norms = head_grad.reshape(head_grad.shape[0], -1).norm(dim=1)
    return norms.topk(min(k, len(norms))).indices.sort().values.cpu()


def last_tokens(
    model: VeilModel, head: nn.Module, head_grad: Tensor, prefixes: list[list[int]], placeholder: int
) -> list[int]:
    """Each sentence's last token from the head gradient's residual (module docstring)."""
    dev = model_device(model)
    T = max(len(p) for p in prefixes) + 1
    ids = torch.full((len(prefixes), T), placeholder, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prefixes):
        ids[b, : len(p) + 1] = torch.tensor([*p, placeholder])
        mask[b, : len(p) + 1] = 1
    batch = {"input_ids": ids.to(dev), "attention_mask": mask.to(dev)}
    seen: dict[str, Tensor] = {}
    hook = head.register_forward_pre_hook(lambda _m, a: seen.__setitem__("h", a[0].detach()))
    try:
        with torch.enable_grad():
            (g,) = torch.autograd.grad(model.loss(model(batch), batch), [head.weight])
    finally:
        hook.remove()
    resid = (head_grad.double() - linear_weight(head, g).double()).cpu()
    out = []
    for b, p in enumerate(prefixes):
        score = -(resid @ seen["h"][b, len(p) - 1].double().cpu())
        score[placeholder] = -torch.inf
        out.append(int(score.argmax()))
    return out


def weight_grad(obs: Observation, module: nn.Module) -> Tensor:
    """The (out, in) weight gradient of a linear or Conv1D module."""
    return linear_weight(module, obs.grad(module))


Scorer = Callable[[Tensor, int], Tensor]
