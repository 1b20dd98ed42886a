"""DAGER-style span attack on text Transformers (Petrov et al. 2024, "DAGER: Exact Gradient
Inversion for Large Language Models", sec. 3-4).

A linear layer ``Y = X W^T`` fed the rows ``x_i`` of ``X`` (every real token of every sentence)
gets the gradient ``dL/dW = sum_i g_i x_i^T``, so the row space of ``dL/dW`` (out, in) lies in
``span{x_i}`` and has rank <= B*T (eq. 2-3 of the paper). When B*T < width the span is a proper
subspace and a vector x is a layer input iff its distance to the span is (numerically) zero:

    d(x) = || x - P P^T x ||_2 / ||x||_2,   P = orthonormal basis of the top singular vectors
                                               of [dW_Q; dW_K; dW_V] (rank cutoff ``rank_tol``).

Layer 1 (`core`): the input of the first attention block is a known function of one token and
its position, ``h0(v, t) = N0(assemble(E_tok[v], E_pos[t]))`` (post-LN encoders: the embedding
LayerNorm of token + position + segment; pre-LN decoders: ``ln_1`` of block 0 on token +
position), so every candidate token is tested at every position in vectorised chunks:
``S_t = {v : d(h0(v, t)) < tol1}``. The candidates are the batch's bag from the token-embedding
gradient (`veil.attacks.presence`) when it is exported (~50 tokens instead of 30k), else the whole
vocabulary. The first layer alone admits every batch token at its position, but also a token at
any position linked to it through shared tokens (``h0(v, t2) ~ h0(v, t1) - h0(w, t1) + h0(w, t2)``
up to the LayerNorm scale), and does not say which sentence a token belongs to. For encoders the
embedding LayerNorm's Jacobian pins every token that occurs at one position (`pin_positions`); layer 2 (its input is the first block's
output, which mixes the whole sentence) resolves that, in `search`:
greedy left-to-right extension for causal decoders (DAGER alg. 1; the layer-2 input at t depends
only on tokens <= t) and an assignment search for bidirectional encoders. An encoder classifier
given the batch size is searched one sentence at a time instead (`peel`: an
exact per-sentence test from the last block's Q gradient, `checks`, on the
[CLS] row or, mean-pooled, on every row; each found sentence's own gradient is subtracted from
the observation), which keeps working when B*T approaches the width ([CLS] pooling). Where the
layer-2 span is crowded or full, peeling scores a sentence by its block-1 MLP inputs' distance to
the row space of the MLP down-projection's gradient instead (`mlp`: 4x the width, so it keeps a
gap up to B*T = 4 width; exact below its rank limit, graded at it). At that limit
a position's MLP input still reads the token before it far more than the rest,
so `suffix` grows each length's sentence from its [SEP] leftwards, each token the one that makes
the next position cost least. The joint assignment search is the fallback where that test has no gap.

Dropout makes the layer inputs ``mask * x / (1 - p)``: no longer in the span of clean vectors.
The exact check here then passes nothing (token recovery 0.000 is the check failing, not
protection): `robust` (``span-robust``) replaces it with a test that searches
for the dropped coordinates, and recovers such updates.

The package, bottom up: `core` (spans, layer inputs, layer-1 candidates, LayerNorm pins), `checks`
(the peeling search's exact sentence test), `search` (decoder extension, encoder assignment),
`residual` / `score` / `mlp` / `walker` / `strategy` / `schedule` / `prefix` / `suffix` / `walks` / `peel`
(the peeling search), `robust_search` / `robust`
(``span-robust``), and one module per registered attack: `attack` (``span``), `mjp`
(``span-mjp``), `robust` (``span-robust``). Nothing imports upward.
"""

from veil.attacks.span.attack import SpanAttack, SpanOptions
from veil.attacks.span.core import Span, layer_span, position_candidates
from veil.attacks.span.down import SpanDownAttack, SpanDownOptions
from veil.attacks.span.mjp import SpanMJPAttack, SpanMJPOptions
from veil.attacks.span.robust import SpanRobustAttack, SpanRobustOptions

__all__ = [
    "Span",
    "SpanAttack",
    "SpanDownAttack",
    "SpanDownOptions",
    "SpanMJPAttack",
    "SpanMJPOptions",
    "SpanOptions",
    "SpanRobustAttack",
    "SpanRobustOptions",
    "layer_span",
    "position_candidates",
]
