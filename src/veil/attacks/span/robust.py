"""Span attack under client dropout (DAGER, Petrov et al., NeurIPS 2024, "DAGER: Exact Gradient
Inversion for Large Language Models", sec. 3-4, made robust to dropout).

DAGER (eq. 2-3): a linear layer ``Y = X W^T`` fed the rows ``x_i`` of ``X`` (every real token of
every sentence) gets ``dL/dW = sum_i g_i x_i^T``, so the row space of ``dL/dW`` is ``span{x_i}``,
of rank ``<= B*T``; a candidate input ``x`` is a token of the batch iff its span distance
``d(x) = ||x - P P^T x|| / ||x||`` is zero (P: orthonormal basis of the row space of the first
block's stacked Q/K/V weight gradients). Layer 1's input is a known function of a token and its
position, so every (token, position) pair is tested (`veil.attacks.span`); layer 2 orders them
into sentences (`veil.attacks.span.search`).

What dropout changes. In train mode with rate p the first block's input is
``x'_i = m_i * x_i / (1 - p)``, m_i an unknown 0/1 mask per coordinate (post-LN encoders: the
dropout follows the embedding LayerNorm, x = LN(E_tok[v] + E_pos[t] + s); pre-LN decoders: it
precedes block 0's ``ln_1``, x = E_tok[v] + E_pos[t]). The gradient is still exactly
``sum_i g_i x'_i^T``: its row space is exactly ``S = span{x'_i}``, still of rank <= B*T, but the
clean vector x of a true pair is no longer in it (far from it: a plain ranking by distance
misplaces many of a sentence's tokens, and at larger batches true pairs rank anywhere in the
bag), so the exact check of `span` passes nothing. The attacker who knows that
dropout is used (the rate from the model config) but not the masks asks instead whether SOME
mask puts x in S:

    r(x) = min over a, and over a drop set K of <= k_max coordinates, of
           || (x - P a)_{not K} || / ||x_{not K}||      with  (P a)_K ~ 0,

i.e. a robust regression of x on the basis P in which ~p*width coordinates are outliers whose
fitted value is 0. For a true pair ``P a = (1 - p) x'`` fits every kept coordinate exactly, so
r(x) is again zero up to float rounding (~1e-7), while a wrong pair keeps a residual >= ~0.05
(MiniLM, batch 1 and 4). It is solved per candidate, batched over the candidates, by iteratively
reweighted least squares for the L1 regression ``min_a ||x - P a||_1`` (sparse outliers), then a
few hard steps that drop the coordinates nearer 0 than x and refit on the rest (k_max = p*width
+ 5 standard deviations of the binomial drop count). For pre-LN decoders x' is seen through
``ln_1``: ``(h - beta) / gamma = (x' - mean) / std``, so the basis used is that of
``{(S - beta) / gamma, 1}`` (two more directions) and the target is x itself.

Layer 2 (the second block's Q/K/V gradients) then assigns the passing pairs to sentences and
lengths: its input mixes the sentence, and dropout inside block 0 (attention probabilities and
hidden states) is not sparse per coordinate, so there it is a ranking, not a test: the
encoder assignment search and the decoder's left-to-right assignment (`veil.attacks.span.robust_search`)
minimise the clean model's layer-2 span distances (no sentence has to pass a threshold).

What it recovers on the pretrained MiniLM and gpt-tiny under client dropout 0.1, beside the
exact check: docs/results.md, section span-robust. Limits: the batch's
real tokens plus k_max must stay well below the width (at ~100 tokens in MiniLM's 384 a few true
pairs already miss ``tol1``; veil's width-96 transformer4 holds one or two sentences), and a
tied LM head (GPT-2) gives no bag of tokens, so the whole vocabulary would be tested
(``max_pairs`` refuses it).

Attacker knowledge: the weights it sent, the exported gradients (layers 1-2 Q/K/V; the token
embedding's for the bag of tokens when exported), the batch size, the public vocabulary and
special tokens, and that the client trains with dropout at the model config's rate; not the
dropout masks, the labels or the batch. Budget in counted work: the (token, position) pairs
tested at layer 1 and the sentences scored at layer 2 (settings), never seconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from veil.attacks import ATTACKS
from veil.attacks.base import Attack, Knowledge, Observation, Reconstruction
from veil.attacks.options import Options, option
from veil.attacks.presence import special_ids
from veil.attacks.span.checks import row_span
from veil.attacks.span.core import Span, Specials, layer_span, qkv_modules, span_reads, vocabulary
from veil.attacks.span.robust_search import decoder_assign, encoder_assign
from veil.errors import VeilError
from veil.models.base import VeilModel, linear_weight


@dataclass(frozen=True)
class SpanRobustOptions(Options):
    p: float | None = option(None, "the client's dropout rate; unset: the model config's")
    tol1: float = option(0.02, "robust layer-1 residual below which a (token, position) pair passes")
    per_position: int | None = option(
        None, "most tokens kept per position; unset: per_sentence x batch size (x unknown_batch without it)"
    )
    per_sentence: int = option(4, "the default per_position's tokens per sentence of the batch")
    unknown_batch: int = option(8, "the batch size the default per_position assumes where none is granted")
    drop_sigmas: float = option(
        5.0, "most coordinates a dropout mask zeroes: p x width + this many binomial standard deviations"
    )
    irls: int = option(20, "iteratively reweighted least-squares steps of the robust fit")
    hard: int = option(4, "hard drop-and-refit steps of the robust fit")
    max_len: int | None = option(None, "longest sentence searched; unset: the knowledge's seq_len, else the model's")
    max_pairs: int = option(200_000, "layer-1 budget in (token, position) pairs")
    presence_tol: float = option(
        1e-7, "the bag of tokens: a token is in it where its embedding-gradient row norm passes this x the largest"
    )
    rank_tol: float = option(1e-6, "layer-2 singular values below rank_tol x the largest are not in the span")
    restarts: int = option(1, "restarts of the encoder assignment search")
    sweeps: int = option(12, "coordinate sweeps per restart of the encoder assignment search")
    refine: int = option(20, "rounds of the pairwise refinement")
    layouts: int = option(6, "encoder assignment search: sentence-length hypotheses tried (shortest first)")
    layout_pool: int = option(
        64, "encoder assignment search: length hypotheses drawn before those ending at every passing [SEP] are kept"
    )
    seed: int | None = option(None, "seed of the search; unset: the knowledge's seed")


#: the defaults, for the parts of the attack used on their own (tests)
DEFAULTS = SpanRobustOptions()
#: candidate (token, position) pairs per robust fit: each holds a (rank x rank) system, so this
#: bounds one call's memory; not a tunable of the test
FIT_CHUNK = 192
#: numerical guards of the fits, not tunables: a LayerNorm gain this close to 0 is held at it (the
#: division stays finite), singular values below `BASIS_TOL` x the largest are rounding of the
#: LayerNorm basis, IRLS weights are capped at 1 / (`IRLS_FLOOR` x the row's largest entry), and
#: `RIDGE` keeps each normal-equation system positive definite
GAIN_FLOOR = 1e-12
BASIS_TOL = 1e-10
IRLS_FLOOR = 1e-7
RIDGE = 1e-12


# ----------------------------------------------------------------------------- the dropped span
def dropout_rate(model: VeilModel, given: float | None = None) -> float:
    """The client's dropout rate: `given`, else the largest rate of the model's dropout modules."""
    if given is not None:
        p = float(given)
    else:
        p = max((float(m.p) for m in model.modules() if isinstance(m, nn.Dropout)), default=0.0)
        cfg = getattr(getattr(model, "hf", None), "config", None)
        p = max([p] + [float(getattr(cfg, k, 0.0) or 0.0) for k in ("hidden_dropout_prob", "embd_pdrop")])
    if not 0.0 <= p < 1.0:
        raise VeilError(f"span-robust: dropout rate must be in [0, 1), got {p}")
    return p


def max_dropped(width: int, p: float, sigmas: float = DEFAULTS.drop_sigmas) -> int:
    """Most coordinates a dropout mask of rate p zeroes (mean + `sigmas` binomial std devs)."""
    if p <= 0:
        return 0
    return min(width - 1, int(math.ceil(p * width + sigmas * math.sqrt(width * p * (1 - p)))))


def first_span(obs: Observation, max_rank: int | None = None) -> Span:
    """The first block's input span in the space where dropout acts (see the module docstring)."""
    model = obs.model
    att = model.attention_layers()[0]
    names = {id(p): n for n, p in model.named_parameters()}
    grads = [linear_weight(m, obs.grads[names[id(m.weight)]]) for m in qkv_modules(att) if obs.has_grad(m)]
    if not grads:
        obs.grad(att.q)  # raises the one-line error naming the missing gradient
    span = row_span(torch.cat(grads).double())
    if max_rank is not None and span.rank > max_rank:
        span = row_span(torch.cat(grads).double(), k=max_rank)
    norm = model.layer_input_norms()[0]
    if not isinstance(norm, nn.LayerNorm):
        return span
    gamma = norm.weight.detach().double() if norm.weight is not None else torch.ones(span.width, dtype=torch.float64)
    beta = norm.bias.detach().double() if norm.bias is not None else torch.zeros(span.width, dtype=torch.float64)
    gamma = torch.where(gamma.abs() < GAIN_FLOOR, torch.full_like(gamma, GAIN_FLOOR), gamma)
    vecs = torch.cat([span.basis.T / gamma, (beta / gamma)[None], torch.ones(1, span.width, dtype=torch.float64)])
    return row_span(vecs, tol=BASIS_TOL)


def clean_inputs(model: VeilModel, ids: Tensor, positions: Tensor) -> Tensor:
    """The pre-dropout first-block input of each pair (ids[k], positions[k]): (len(ids), width)."""
    tok = model.token_embedding().weight[ids]
    pos = model.position_table().reshape(-1, tok.shape[-1])[positions]
    return model.assemble(tok.unsqueeze(1), pos.unsqueeze(1), {})[:, 0]


# ----------------------------------------------------------------------------- the robust test
def robust_residuals(
    y: Tensor, basis: Tensor, k_max: int, irls: int = DEFAULTS.irls, hard: int = DEFAULTS.hard
) -> Tensor:
    """r(y) of every row of `y` (C, D) against the span of `basis` (D, N), allowing <= k_max
    coordinates to be dropped (module docstring). float64; vectorised over the rows."""
    y = y.double()
    Q = basis.double()
    if k_max == 0 or Q.shape[1] == 0:
        return (y - (y @ Q) @ Q.T).norm(dim=1) / y.norm(dim=1).clamp_min(1e-300)
    n = Q.shape[1]
    eye = torch.eye(n, dtype=torch.float64)
    outer = (Q[:, :, None] * Q[:, None, :]).reshape(len(Q), n * n)  # row d: q_d q_d^T, so W @ outer = Q^T diag(w) Q
    floor = IRLS_FLOOR * y.abs().amax(1, keepdim=True).clamp_min(1e-300)
    w = torch.ones_like(y)

    def fit(weights: Tensor) -> Tensor:
        m = (weights @ outer).view(-1, n, n) + RIDGE * eye  # (C, N, N), symmetric positive definite
        rhs = ((y * weights) @ Q).unsqueeze(-1)
        chol, info = torch.linalg.cholesky_ex(m)
        a = torch.cholesky_solve(rhs, chol)
        bad = info != 0
        if bool(bad.any()):
            a[bad] = torch.linalg.solve(m[bad], rhs[bad])
        return a.squeeze(-1) @ Q.T

    for _ in range(irls):  # L1 regression by IRLS: the dropped coordinates are sparse outliers
        s = fit(w)
        w = 1.0 / (y - s).abs().clamp_min(floor)
        w = w / w.amax(1, keepdim=True)
    keep = torch.ones_like(y)
    for _ in range(hard):  # drop the coordinates whose fit is nearer 0 than y, refit on the rest
        gain = ((y - s) ** 2 - s**2).clamp_min(0)
        top = gain.topk(k_max, dim=1)
        keep = torch.ones_like(y).scatter_(1, top.indices, (top.values <= 0).double())
        s = fit(keep)
    return ((y - s) * keep).norm(dim=1) / (y * keep).norm(dim=1).clamp_min(1e-300)


def layer1_residuals(
    model: VeilModel, span: Span, vocab: Tensor, max_len: int, k_max: int, o: SpanRobustOptions, chunk: int = FIT_CHUNK
) -> Tensor:
    """r(x(v, t)) for every position t < max_len and token v of `vocab`: (max_len, len(vocab))."""
    pairs = torch.cartesian_prod(torch.arange(max_len), torch.arange(len(vocab)))  # (P*V, 2)
    out = torch.empty(len(pairs), dtype=torch.float64)
    for i in range(0, len(pairs), chunk):
        t, j = pairs[i : i + chunk].T
        out[i : i + chunk] = robust_residuals(clean_inputs(model, vocab[j], t), span.basis, k_max, o.irls, o.hard)
    return out.view(max_len, len(vocab))


def position_sets(res: Tensor, vocab: Tensor, tol: float, per_position: int) -> list[Tensor]:
    """Per position the tokens with r < tol, best first, at most `per_position`."""
    out = []
    for row in res:
        idx = torch.nonzero(row < tol).flatten()
        idx = idx[row[idx].argsort()][:per_position]
        out.append(vocab[idx])
    return out


# ----------------------------------------------------------------------------- the attack
@ATTACKS.register(
    "span-robust", help="DAGER-style span attack that survives client dropout (robust layer-1 test, layer-2 ranking)"
)
class SpanRobustAttack(Attack[SpanRobustOptions]):
    """DAGER's span attack with a layer-1 test robust to client dropout (options: `SpanRobustOptions`)."""

    modality = "text"
    observes = frozenset({"gradient", "delta"})
    knows = (
        "the update, the weights, batch size, length and tokenizer, and that the client trains with dropout at rate p "
        "(from the model config), not the dropout masks"
    )
    needs_attention_layers = (2, "to order tokens into sentences")

    def budget(self) -> dict[str, int]:
        """{}: no open-ended search; the work is fixed by the input and the options (layer 1:
        vocabulary x positions, refused above `max_pairs`; layer 2: `restarts` x `sweeps` over at
        most a few length layouts, then `refine` rounds)."""
        return {}

    def reads(self, model: VeilModel) -> list[str]:
        """The first two attention layers' Q/K/V and the last one's Q, the token embedding (its
        bag) and the position table, and the down-projections the peeling search scores with."""
        return span_reads(model)

    def _reconstruct(self, obs: Observation, know: Knowledge) -> Reconstruction:
        model, o = obs.model, self.options
        B = int(know.batch_size) if know.batch_size else None
        width = model.position_table().shape[-1]
        max_len = _max_len(model, o, know)
        p = dropout_rate(model, o.p)
        k_max = max_dropped(width, p, o.drop_sigmas)
        was = model.training
        model.eval()
        try:
            with torch.no_grad():
                span1 = first_span(obs, max_rank=B * max_len if B else None)
                vocab, res, cands = self._layer1(obs, know, span1, max_len, k_max)
                B = B or max([len(c) for c in cands] + [1])  # not granted: the most pairs passing at one position
                span2 = layer_span(obs, 1, o.rank_tol)
                seqs, info = self._layer2(model, know, span2, cands, B)
        finally:
            model.train(was)
        stats = {
            "dropout_p": p,
            "k_max": k_max,
            "rank1": span1.rank,
            "rank2": span2.rank,
            "width": width,
            "pairs_tested": int(res.numel()),
            "vocabulary": len(vocab),
            "candidates_per_position": [len(c) for c in cands],
            **info,
        }
        bag = {int(v) for c in cands for v in c.tolist()} - set(special_ids(model, know.tokenizer))  # as `presence`
        return Reconstruction(token_ids=seqs or [[] for _ in range(B or 1)], token_set=bag, stats=stats)

    def _layer1(
        self, obs: Observation, know: Knowledge, span1: Span, max_len: int, k_max: int
    ) -> tuple[Tensor, Tensor, list[Tensor]]:
        """The robust layer-1 test of every (token, position) pair of the bag (the vocabulary
        without it, up to `max_pairs`): the bag, the residuals and each position's passing tokens."""
        model, o = obs.model, self.options
        vocab = vocabulary(obs, know, o.presence_tol)
        if vocab is None:
            vocab = torch.arange(model.token_embedding().weight.shape[0])
        if len(vocab) * max_len > o.max_pairs:
            raise VeilError(
                f"span-robust: {len(vocab)} tokens x {max_len} positions exceed max_pairs={o.max_pairs}; "
                "raise it or export the token-embedding gradient (the bag filter)"
            )
        res = layer1_residuals(model, span1, vocab, max_len, k_max, o)
        B = know.batch_size or o.unknown_batch
        return vocab, res, position_sets(res, vocab, o.tol1, o.per_position or o.per_sentence * B)

    def _layer2(
        self, model: VeilModel, know: Knowledge, span2: Span, cands: list[Tensor], B: int
    ) -> tuple[list[list[int]], dict[str, object]]:
        """The passing pairs ordered into sentences by layer 2: left to right (decoders) or the
        assignment search (encoders)."""
        specials = Specials.of(model, know)
        if model.task == "lm":
            return decoder_assign(model, span2, cands, specials, B)
        seed = know.seed if self.options.seed is None else self.options.seed
        return encoder_assign(model, span2, cands, specials, B, seed=seed, o=self.options)


def _max_len(model: VeilModel, o: SpanRobustOptions, know: Knowledge) -> int:
    """The longest sentence searched: the option, else the knowledge's length, else the model's."""
    limit = model.position_table().reshape(-1, model.position_table().shape[-1]).shape[0]
    max_len = int(o.max_len or know.seq_len or limit)
    if max_len > limit:
        raise VeilError(f"span-robust: max_len {max_len} exceeds the model's {limit} positions")
    return max_len
