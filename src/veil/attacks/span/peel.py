"""Peeling search of the span attack for encoder classifiers ([CLS]- or mean-pooled) whose batch holds more tokens than
the layer-1 span can separate (B*T close to or above the width; Petrov et al. 2024 stop there).

Two exact tests the DAGER paper does not use, both from the attacker's own view (weights, loss,
the exported gradients):

* `CLSCheck` (`veil.attacks.span_checks`): a [CLS]-pooled classifier reads only the last block's
  [CLS] output, so the last block's Q projection gradient has rank <= B and its row space is
  spanned by the B [CLS] inputs of that block. A candidate sentence is in the batch iff its own
  [CLS] input lies in that span. A mean-pooled one (sentence-transformer checkpoints) reads every
  token's output: where the B*T rows leave that span a gap, a sentence is in the batch iff all
  its last-block inputs lie in it.
* `Residual`: the client's loss is the batch mean, so once a sentence and its label are known,
  its gradient (/ B) is subtracted from every exported gradient; the rest belongs to the other
  sentences alone, with fewer tokens behind each span (which regains its gap).

`peel_search` finds one sentence at a time by an iterated local search (`_Walker`) per length
hypothesis on the layer-2 span distance plus the token-embedding-gradient match (`SentenceScore`),
accepts the first sentence that passes `CLSCheck`, peels it off and repeats.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from veil.attacks.span import Span, qkv_modules, recording_inputs
from veil.attacks.span_checks import CLSCheck, _row_span
from veil.attacks.span_search import _last_position
from veil.models.base import VeilModel

#: what one scoring call costs beyond its tokens, in token evaluations: measured on transformer4
#: (width 96, 1 thread) ~25 ms per call against ~0.15 ms per token scored with the gradient match
CALL_COST = 150


class Residual:
    """The observed gradients minus the gradients of the sentences already found ("peeling").

    The client's loss is the batch mean of per-sentence losses, so the observed gradient is
    ``(1/B) sum_b grad l(s_b, y_b)``: once a sentence s and its label y are known, the attacker (who
    has the weights and the loss) computes ``grad l(s, y) / B`` and subtracts it. The rest is the
    gradient of the other sentences alone: fewer tokens behind every layer's span, so the spans of
    layers 1 and 2 regain a gap when B*T >= width and the layer-1 candidates shrink. The label is
    the one whose subtraction drops the rank of the last block's Q gradient (`CLSCheck`): by one
    ([CLS] pooling), or by the sentence's length (mean pooling).
    """

    def __init__(self, obs: Any, batch_size: int) -> None:
        self.model = obs.model
        self.names = {id(p): n for n, p in self.model.named_parameters()}
        self.grads = {n: g.detach().double().clone() for n, g in obs.grads.items()}
        self.batch_size = batch_size
        self.left = batch_size

    def weight_grad(self, module: Any) -> Tensor:
        from veil.models.base import linear_weight

        return linear_weight(module, self.grads[self.names[id(module.weight)]])

    def token_grad(self) -> Tensor | None:
        """The residual token-embedding gradient (vocab, width), or None if it was not exported."""
        name = self.names.get(id(getattr(self.model.token_embedding(), "weight", None)))
        g = self.grads.get(name) if name is not None else None
        return g if g is not None and g.dim() == 2 else None

    def position_grad(self) -> Tensor | None:
        """The residual position-table gradient (rows, width), or None if it was not exported."""
        name = self.names.get(id(self.model.position_table()))
        g = self.grads.get(name) if name is not None else None
        return g.reshape(-1, g.shape[-1]) if g is not None else None

    def layer_span(self, layer: int, rank_tol: float) -> Span:
        att = self.model.attention_layers()[layer]
        return _row_span(torch.cat([self.weight_grad(m) for m in qkv_modules(att)]), tol=rank_tol)

    def sentence_grads(self, ids: list[int], label: int) -> dict[str, Tensor]:
        model = self.model
        x = torch.tensor([ids])
        batch = {"input_ids": x, "attention_mask": torch.ones_like(x), "labels": torch.tensor([label])}
        params = {n: p for n, p in model.named_parameters() if n in self.grads}
        with torch.enable_grad():
            grads = torch.autograd.grad(model.loss(model(batch), batch), list(params.values()), allow_unused=True)
        return {
            n: (g.double() / self.batch_size if g is not None else torch.zeros_like(self.grads[n]))
            for n, g in zip(params, grads)
        }

    def peel(self, ids: list[int], check: CLSCheck) -> tuple[int, float]:
        """Subtract sentence `ids` with the label that leaves the check's gradient at `check.rank_after`."""
        name = self.names[id(check.module.weight)]
        scale = float(torch.linalg.svdvals(self.grads[name])[0])
        best: tuple[float, int, dict[str, Tensor]] | None = None
        for y in range(int(getattr(self.model.classifier(), "out_features", 2))):
            g = self.sentence_grads(ids, y)
            sv = torch.linalg.svdvals(self.grads[name] - g[name])
            k = check.rank_after(len(ids))
            r = float(sv[k] / max(scale, 1e-300)) if 0 <= k < len(sv) else 0.0
            if best is None or r < best[0]:
                best = (r, y, g)
        assert best is not None
        for n, g in best[2].items():
            self.grads[n] -= g
        self.left -= 1
        return best[1], best[0]


def _probe(model: VeilModel, mods: list[Any], stop: Any, ids: Tensor, mask: Tensor) -> dict[int, Tensor]:
    """The inputs of `mods` for sentences `ids`, stopping the forward pass at `stop`'s input."""
    with recording_inputs(mods, stop=stop) as seen:
        model({"input_ids": ids, "attention_mask": mask})
    return seen


class SentenceScore:
    """Scores of equal-length candidate sentences: a per-position cost (N, T) and the [CLS] distance (N,).

    The per-position cost is the layer-2 span distance, plus, with ``tok_grad`` (the residual
    token-embedding gradient), the embedding-gradient mismatch: a token v that occurs once in the
    (remaining) batch has ``dL/dE[v] = (1/B) dl_b/dx_{b,t}``, the gradient of its own sentence's loss
    at its one position, which the attacker recomputes for a candidate sentence (one backward pass
    per label, the best label kept). With the rest of the sentence even half wrong, a right token
    matches its row to ~5-10 % and a wrong one misses by >= 35 % (measured on transformer4 at
    B*T > width): a per-position test that, unlike the spans, does not need B*T < width. Tokens
    that occur several times get a capped cost (`cap`) wherever they are put.

    ``with_cls=False`` stops the forward pass at layer 2 (the [CLS] distance is then +inf): the
    search objective when the layer-2 span leaves room (codimension >= width / 8), where layer 2
    alone pins every position; `cls` scores the candidates the search settles on."""

    def __init__(
        self,
        model: VeilModel,
        span2: Span,
        check: CLSCheck,
        with_cls: bool = True,
        cls_weight: float = 10.0,
        tok_grad: Tensor | None = None,
        batch_size: int = 1,
        cap: float = 0.1,
        prior: PositionPrior | None = None,
    ) -> None:
        self.model, self.span2, self.check, self.with_cls, self.cls_weight = model, span2, check, with_cls, cls_weight
        self.prior = prior
        self.q2 = model.attention_layers()[1].q
        self.tok_grad = tok_grad.float() if tok_grad is not None and with_cls else None
        self.batch_size, self.cap = batch_size, cap

    def __call__(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        pc, dc = self._scores(ids)
        return (pc + self.prior(ids) if self.prior is not None else pc), dc

    def _scores(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        if self.tok_grad is not None:
            return self._with_gradient(ids)
        mods = [self.q2, self.check.module] if self.with_cls else [self.q2]
        with torch.no_grad():
            seen = _probe(self.model, mods, mods[-1], ids, torch.ones_like(ids))
            d2 = self.span2.distance(seen[id(self.q2)].double()).float()
            dc = (
                self.check.distance(seen[id(self.check.module)])
                if self.with_cls
                else torch.full((len(ids),), float("inf"))
            )
        return d2, dc

    def _with_gradient(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        model = self.model
        mask = torch.ones_like(ids)
        batch = {"input_ids": ids, "attention_mask": mask}
        with recording_inputs([self.q2, self.check.module]) as seen, torch.enable_grad():
            tok = model.token_embedding().weight.detach()[ids].requires_grad_(True)
            logits = model.forward_from_embeddings(model.assemble(tok, model.position_embeddings(tok), batch), batch)
            target = self.tok_grad[ids]  # (N, T, D)
            tnorm = target.norm(dim=-1).clamp_min(1e-30)
            best: Tensor | None = None
            C = logits.shape[-1]
            if C == 2:  # dl/dx = (p_1 - y) d(logit_1 - logit_0)/dx: one backward pass for both labels
                (jac,) = torch.autograd.grad((logits[:, 1] - logits[:, 0]).sum(), tok)
                p1 = logits.detach().softmax(-1)[:, 1]
                grads = [(p1 - y)[:, None, None] * jac for y in range(2)]
            else:
                grads = [
                    torch.autograd.grad(
                        nn.functional.cross_entropy(logits, torch.full((len(ids),), y), reduction="sum"),
                        tok,
                        retain_graph=y < C - 1,
                    )[0]
                    for y in range(C)
                ]
            for g in grads:
                e = ((g / self.batch_size - target).norm(dim=-1) / tnorm).clamp_max(self.cap).detach()
                best = e if best is None else torch.where((e.sum(1) < best.sum(1))[:, None], e, best)
        d2 = self.span2.distance(seen[id(self.q2)].double()).float()
        dc = self.check.distance(seen[id(self.check.module)])
        assert best is not None
        return d2 + best, dc

    def cls(self, ids: Tensor) -> float:
        with torch.no_grad():
            z = _probe(self.model, [self.check.module], self.check.module, ids, torch.ones_like(ids))[
                id(self.check.module)
            ]
        return float(self.check.distance(z).max())


class PositionPrior:
    """Where each batch token sits, from the two embedding gradients (any B*T).

    The token and position embeddings are added before anything else, so with ``u_{b,t}`` the
    gradient of the loss at the summed embedding of token (b, t): row v of the token table's
    gradient is ``sum of u over the occurrences of v`` and row t of the position table's gradient
    is ``sum_b u_{b,t}`` (padding gets none). A token that occurs once is one ``u``, so position
    row t is (close to) the sum of the rows of the tokens that sit at t: least squares of each
    position row on the bag's token rows gives coefficients ~1 for them and ~0 for the rest
    (a repeated token's occurrences are not in that basis one by one, which blurs the fit;
    measured on transformer4 at B=4 and 90-106 tokens: 75-80 % of all true (token, position)
    pairs get >= 0.5, with ~3-5 tokens per position above 0.5 against ~70 in the bag). Every walk starts at the best token of each position and its
    kicks favour the best three (`_Walker.start_at`). Only while the layer-2 span is crowded (its
    objective is already soft there) is ``weight * (1 - clamp(c_{t,v}, 0, 1))`` added to each
    position's cost: with a clear layer-2 gap the true sentence is the exact zero of that
    objective, and the prior's cost on repeated tokens moved its minimum (measured: a batch solved
    in 8 s went unsolved in 300 s).
    """

    def __init__(self, res: Residual, length: int, weight: float = 0.2) -> None:
        self.weight = weight
        self.cost: Tensor | None = None
        G, P = res.token_grad(), res.position_grad()
        if G is None or P is None or weight <= 0:
            return
        norms = G.norm(dim=1)
        bag = torch.nonzero(norms > 1e-4 * float(norms.max())).flatten()  # peeled rows leave ~1e-7 of float32 residue
        if not len(bag):
            return
        T = min(length, P.shape[0])
        C = torch.linalg.lstsq(G[bag].T, P[:T].T).solution.T  # (T, V): position row t ~ C[t] @ G[bag]
        cost = torch.ones(T, G.shape[0], dtype=torch.float32)
        cost[:, bag] = (1 - C.clamp(0, 1)).float()
        self.cost = cost

    def __call__(self, ids: Tensor) -> Tensor:
        """(N, n) prior cost of each token at its position (zeros when there is no prior)."""
        if self.cost is None:
            return torch.zeros(ids.shape, dtype=torch.float32)
        n = min(ids.shape[1], self.cost.shape[0])
        out = torch.ones(ids.shape, dtype=torch.float32)
        out[:, :n] = self.cost[torch.arange(n), ids[:, :n]]
        return self.weight * out

    def best(self, t: int, allowed: Tensor) -> int | None:
        """The allowed token with the lowest prior cost at position t (None without a prior)."""
        if self.cost is None or t >= self.cost.shape[0]:
            return None
        return int(allowed[int(self.cost[t, allowed].argmin())])


class _Walker:
    """Iterated local search for one sentence of a fixed length on the summed per-position cost
    plus ``cls_weight`` x the [CLS] distance: coordinate descent over each position's candidates
    and swaps of two positions' tokens (the typical trap: two tokens that pass layer 1 at each
    other's position, exchanged) until neither helps, then a random kick of `kick` positions
    (drawn in proportion to their cost) from the best sentence found. `step` runs one sweep, so
    the caller can interleave many walkers finely.

    With ``narrow = k`` (and a position prior, `start_at`) a sweep first tries only each position's
    k best tokens by the prior (and swaps between them): the once-only tokens of a batch rank in
    its top 4 at their own position (measured on MiniLM, 4 batches of 4 SST-2 sentences, 248 of
    248), a repeated one mostly in the top 8. Where such a sweep helps no more, the sentence is
    checked, then the next sweep tries every candidate; only where that one does not help either
    is it a local minimum (kick). The neighbourhood of a local minimum is thus unchanged; the
    sweeps on the way there cost k instead of ~40-60 candidates per position."""

    def __init__(self, sets: list[Tensor], rng: np.random.Generator, kick: int = 3, chunk: int = 2048) -> None:
        self.sets, self.rng, self.kick, self.chunk = sets, rng, kick, chunk
        self.n = len(sets)
        self.allowed = [set(s.tolist()) for s in sets]
        self.free = [t for t, s in enumerate(sets) if len(s) > 1]
        self.x = self.random()
        self.ranked: dict[int, Tensor] | None = None  # per free position, its tokens by prior cost (`start_at`)
        self.cur: tuple[float, float] | None = None  # (objective, cls distance) of x; None: not scored yet
        self.best: tuple[float, float, Tensor] | None = None  # the best local minimum: (objective, cls distance, ids)
        self.steps = 0  # sentences scored
        self.work = 0.0  # their cost in token evaluations, CALL_COST per scoring call included
        self.sweeps = 0
        self.last: float | None = None  # work of the last sweep
        self.narrow: int | None = None  # sweeps try each position's `narrow` best tokens by the prior first
        self._wide = False  # the next sweep tries every candidate (a narrow sweep stalled)

    def random(self) -> Tensor:
        return torch.tensor([[int(s[self.rng.integers(len(s))]) for s in self.sets]])

    def _draw(self, t: int) -> int:
        """A token for a kicked position: half the time one of the 3 best by the position prior."""
        s = self.sets[t]
        if self.ranked is not None and self.rng.random() < 0.5:
            top = self.ranked[t][:3]
            return int(top[self.rng.integers(len(top))])
        return int(s[self.rng.integers(len(s))])

    def start_at(self, prior: PositionPrior) -> None:
        """Start every free position at its allowed token of lowest prior cost; kicks then favour
        the prior's best tokens (`_draw`)."""
        if prior.cost is None:
            return
        self.ranked = {
            t: self.sets[t][prior.cost[t, self.sets[t]].argsort()] if t < prior.cost.shape[0] else self.sets[t]
            for t in self.free
        }
        for t in self.free:
            v = prior.best(t, self.sets[t])
            if v is not None:
                self.x[0, t] = v

    def seed(self, prefix: list[int]) -> None:
        """Start from `prefix` (content tokens from position 1 on, where allowed) instead of at random."""
        for t, v in enumerate(prefix[: self.n - 2], start=1):
            if v in self.allowed[t]:
                self.x[0, t] = v

    def _objective(self, score: SentenceScore, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        fs, dcs, pcs = [], [], []
        for i in range(0, len(x), self.chunk):
            pc, dc = score(x[i : i + self.chunk])
            fs.append(pc.sum(1) + (score.cls_weight * dc if score.with_cls else 0))
            dcs.append(dc)
            pcs.append(pc)
        self.steps += len(x)
        self.work += len(x) * self.n + CALL_COST * -(-len(x) // self.chunk)
        return torch.cat(fs), torch.cat(dcs), torch.cat(pcs)

    def _narrowed(self) -> bool:
        return self.narrow is not None and self.ranked is not None and not self._wide

    def _moves(self, t: int) -> Tensor:
        """The tokens the current sweep tries at position t."""
        return self.ranked[t][: self.narrow] if self._narrowed() else self.sets[t]  # type: ignore[index]

    def sweep_size(self) -> int:
        """Candidate tokens the next sweep tries over all positions (its cost estimate)."""
        return sum(len(self._moves(t)) for t in self.free) + self.n - len(self.free)

    def _swaps(self) -> Tensor:
        x = self.x[0].tolist()
        allowed = (
            [set(self._moves(t).tolist()) if t in self.free else self.allowed[t] for t in range(self.n)]
            if self._narrowed()
            else self.allowed
        )
        pairs = [
            (i, j)
            for a, i in enumerate(self.free)
            for j in self.free[a + 1 :]
            if x[i] != x[j] and x[j] in allowed[i] and x[i] in allowed[j]
        ]
        var = self.x.repeat(len(pairs), 1)
        for r, (i, j) in enumerate(pairs):
            var[r, i], var[r, j] = x[j], x[i]
        return var

    def step(self, score: SentenceScore) -> tuple[float, float, Tensor]:
        """One sweep (every position, then the swaps); at a local minimum the next step kicks.
        Returns (objective, [CLS] distance, ids) of the current sentence (the [CLS] distance is
        only computed at local minima when the objective does not include it)."""
        if self.cur is None:
            f, dc, self._pc = self._objective(score, self.x)
            self.cur = (float(f[0]), float(dc[0]))
        improved = False
        for t in self.rng.permutation(self.free).tolist():
            moves = self._moves(t)
            var = self.x.repeat(len(moves), 1)
            var[:, t] = moves
            f, dc, pc = self._objective(score, var)
            j = int(f.argmin())
            if float(f[j]) < self.cur[0] - 1e-12:
                self.x, self.cur, self._pc, improved = (
                    var[j : j + 1].clone(),
                    (float(f[j]), float(dc[j])),
                    pc[j : j + 1],
                    True,
                )
        var = self._swaps()
        if len(var):
            f, dc, pc = self._objective(score, var)
            j = int(f.argmin())
            if float(f[j]) < self.cur[0] - 1e-12:
                self.x, self.cur, self._pc, improved = (
                    var[j : j + 1].clone(),
                    (float(f[j]), float(dc[j])),
                    pc[j : j + 1],
                    True,
                )
        self.sweeps += 1
        out = (self.cur[0], self.cur[1], self.x.clone())
        if improved:
            self._wide = False
            return out
        if not score.with_cls:  # a (narrow or true) local minimum: check it
            out = (out[0], score.cls(self.x), out[2])
        if self._narrowed():  # the prior's tokens help no more: next, every candidate (no kick)
            self._wide = True
            return out
        self._wide = False
        if self.best is None or out[0] < self.best[0]:
            self.best = out
            self._best_pc = self._pc
        self.x = self.best[2].clone()  # kick from the best local minimum, where the per-position cost is high
        if self.free:
            w = self._best_pc[0, self.free].double().numpy() + 1e-12
            for t in self.rng.choice(
                self.free, size=min(self.kick, len(self.free)), replace=False, p=w / w.sum()
            ).tolist():
                self.x[0, t] = self._draw(t)
        self.cur = None
        return out


def peel_search(
    obs: Any,
    res: Residual,
    cands_of: Any,
    specials: Any,
    *,
    seed: int,
    tol_cls: float = 1e-4,
    rank_tol: float = 1e-6,
    budget: int = 500_000,
    min_len: int = 3,
    prior_weight: float = 0.2,
    narrow: int = 8,
) -> tuple[list[list[int]], dict[str, Any]] | None:
    """Find the batch one sentence at a time (see `Residual`, `CLSCheck`): per length hypothesis
    (where [SEP] passes layer 1) an iterated local search (`_Walker`), the hypothesis that has
    done the least work stepped next (so short sentences, cheap to score, are tried most); the first sentence whose [CLS] distance is < `tol_cls` is exact:
    it is subtracted from the gradient and the spans, candidates and hypotheses are recomputed.
    `cands_of(span1)` gives the per-position candidates of a layer-1 span. Returns None if the
    [CLS] check does not apply to this model.

    Work, never time, orders and bounds the search, so the result does not depend on the machine
    or its load: `budget` caps the candidate sentences scored (all stages together); a
    hypothesis' work is the tokens it scored plus `CALL_COST` per scoring call (what its sweeps
    cost in time, from counts)."""
    start = time.perf_counter()
    model = obs.model
    rng = np.random.default_rng(seed)
    found: list[list[int]] = []
    labels: list[int] = []
    rounds = steps = 0
    stage_info: list[dict[str, Any]] = []
    best_guess: list[tuple[float, list[int]]] = []
    carried: dict[int, list[int]] = {}  # per length, the best sentence of the previous stage's walker
    note = None
    while res.left > 0 and steps < budget:
        check = CLSCheck(res)
        if not check.usable:
            if not found:
                return None
            break
        span1, span2 = res.layer_span(0, rank_tol), res.layer_span(1, rank_tol)
        cands = cands_of(span1)
        crowded = span2.width - span2.rank < span2.width / 8  # layer 2 alone no longer pins positions
        where = PositionPrior(res, len(cands), weight=prior_weight)
        score = SentenceScore(
            model,
            span2,
            check,
            with_cls=crowded,
            tok_grad=res.token_grad(),
            batch_size=res.batch_size,
            prior=where if where.cost is not None and crowded else None,
        )
        walkers = _walkers(cands, specials, rng, min_len)
        for w in walkers:
            w.start_at(where)
            if w.n in carried:  # the walk of the stage before, at this length, resumes where it stood
                w.seed(carried[w.n][1:-1])
            if not crowded and narrow > 0:
                w.narrow = narrow
        stage_info.append({"left": res.left, "rank1": span1.rank, "rank2": span2.rank, "hypotheses": len(walkers)})
        if not walkers:
            if not found:
                note = "no token passes layer 1 (dropout or noise? raise tol1)"
            break
        hit, t_stage, r0 = None, time.perf_counter(), rounds
        # fair share of work: step the hypothesis whose work after this step would be the least.
        # Work = tokens scored + CALL_COST per scoring call; a sweep's is estimated as n * (candidates
        # of its n positions) + CALL_COST per position until done once, so short hypotheses, cheap to score, sweep several times
        # before a long one starts; a walker's first sweep starts from the longest sentence another
        # (shorter) walker has settled on (a short walker often settles on the prefix of a longer sentence).
        used = [0.0] * len(walkers)
        cost = [float(w.n * w.sweep_size() + CALL_COST * (len(w.free) + 1)) for w in walkers]
        share = _shares(walkers, where, specials.sep)
        while hit is None and steps + sum(w.steps for w in walkers) < budget:
            est = [
                (used[j] + (w.last if w.last is not None else cost[j])) / _merit(w, share[j], crowded)
                for j, w in enumerate(walkers)
            ]
            i = min(range(len(walkers)), key=lambda j: (est[j], j))
            w = walkers[i]
            if (
                w.sweeps == 0 and score.prior is None and w.n not in carried
            ):  # uncrowded: start from a shorter hypothesis' best
                shorter = [v for v in walkers if v.best is not None and v.n < w.n]
                if shorter:
                    w.seed(shorter[-1].best[2][0, 1:-1].tolist())
            before = w.work
            obj, dc, ids = w.step(score)
            w.last = w.work - before
            used[i] += w.last
            rounds += 1
            if dc < tol_cls:
                hit = ids[0].tolist()
        steps += sum(w.steps for w in walkers)
        stage_info[-1].update(
            rounds=rounds - r0,
            seconds=round(time.perf_counter() - t_stage, 1),
            length=len(hit) if hit else None,
            lengths=[w.n for w in walkers],
        )
        busiest = sorted(zip(walkers, used), key=lambda x: -x[1])[:6]
        stage_info[-1].update(
            work_by_length={w.n: int(u) for w, u in busiest}, sweeps_by_length={w.n: w.sweeps for w, _ in busiest}
        )
        if hit is None:
            best_guess = sorted(
                ((w.best[0] / w.n, w.best[2][0].tolist()) for w in walkers if w.best is not None), key=lambda x: x[0]
            )
            break
        carried = {w.n: w.best[2][0].tolist() for w in walkers if w.best is not None and w.best[2][0].tolist() != hit}
        label, _ = res.peel(hit, check)
        found.append(hit)
        labels.append(label)
    seqs = list(found)
    for _, s in best_guess:  # unsolved sentences: the hypotheses with the lowest cost per position
        if len(seqs) >= res.batch_size:
            break
        seqs.append(s)
    info = {
        "sentences_exact": len(found),
        "walker_steps": rounds,
        "sentences_scored": steps,
        "stages": stage_info,
        "labels_inferred": labels,
        "search_seconds": time.perf_counter() - start,
    }
    return seqs, ({"note": note, **info} if note else info)


def _merit(w: _Walker, share: float, crowded: bool) -> float:
    """A hypothesis' claim on work: its share, and in a crowded span also the inverse of its best
    objective per position so far (the true sentence's is ~0.08 on transformer4 at B=4, wrong
    local minima's 2-5x that), so the walks closest to a solution run most."""
    if not crowded or w.best is None:
        return share
    return share / max(w.best[0] / w.n, 0.02)


def _shares(walkers: list[_Walker], where: PositionPrior, sep: int | None) -> list[float]:
    """Work shares of the length hypotheses when every length passes layer 1 (a crowded span):
    0.1 + the position prior's coefficient of [SEP] at the hypothesis' last position, so the
    lengths where the position gradient puts a [SEP] are searched first (measured on a batch of
    lengths 19/22/32/32: coefficients 0.26 at 21 and 0.81 at 31, < 0.1 at the other 27 ends)."""
    if where.cost is None or sep is None:
        return [1.0] * len(walkers)
    T = where.cost.shape[0]
    return [0.1 + (float((1 - where.cost[w.n - 1, sep]).clamp(0, 1)) if w.n - 1 < T else 0.0) for w in walkers]


def _walkers(cands: list[Tensor], specials: Any, rng: np.random.Generator, min_len: int) -> list[_Walker]:
    """One walker per length hypothesis n: [SEP] passes layer 1 at n - 1 (or n is the last position
    with candidates), [CLS] at 0, every content position has a candidate."""
    T = _last_position(cands)
    if T == 0:
        return []
    sep, cls = specials.sep, specials.cls
    special = {v for v in (sep, cls, specials.pad) if v is not None}
    ends = sorted({t + 1 for t in range(T) if sep is not None and sep in set(cands[t].tolist())} | {T})
    out = []
    for n in ends:
        if n < min_len:
            continue
        content = [
            torch.tensor([v for v in c.tolist() if v not in special], dtype=torch.long) for c in cands[1 : n - 1]
        ]
        if any(len(c) == 0 for c in content):
            continue
        first = torch.tensor([cls if cls is not None else int(cands[0][0])])
        last = torch.tensor([sep]) if sep is not None else cands[n - 1]
        out.append(_Walker([first, *content, last], rng))
    return out
