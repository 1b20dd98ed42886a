"""The span attack's options (`veil.attacks.span.attack`, DAGER, Petrov et al. 2024, with veil's
peeling search): every tunable of every search in one frozen object, passed down as one."""

from __future__ import annotations

from dataclasses import dataclass

from veil.attacks.options import Options, option
from veil.attacks.span.work import WORK


@dataclass(frozen=True)
class SpanOptions(Options):
    """Every tunable of the span attack, stated once (docs/span.md lists them with what they set).
    The searches take this object; `DEFAULTS` holds the defaults for parts built on their own."""

    tol1: float = option(1e-3, "layer-1 span distance below which a (token, position) pair passes")
    tol2: float = option(1e-3, "layer-2 span distance below which a sentence position passes")
    rank_tol: float = option(1e-6, "singular values below rank_tol x the largest are not in the span")
    max_len: int | None = option(None, "longest sentence searched; unset: the knowledge's seq_len, else the model's")
    presence_filter: bool = option(True, "test only the tokens the embedding gradient shows (and the specials)")
    max_per_position: int | None = option(None, "keep at most this many layer-1 candidates per position")
    layernorm_positions: bool = option(True, "pin encoder tokens to their position by the embedding LayerNorm")
    tol_ln: float = option(
        1e-6, "cosine floor of the LayerNorm pins (a true pin sits at float rounding, a false one far above)"
    )
    peel: bool = option(True, "encoder classifiers: peel one exact sentence at a time (needs the batch size)")
    tol_cls: float = option(1e-4, "last-block span distance below which a peeled sentence is exact")
    tol_all: float = option(
        1e-3,
        "mean pooling: the exact test's tolerance on the largest of a sentence's last-block rows (float32 "
        "rounding over every row of the sentence sits above tol_cls; one wrong token moves them far more)",
    )
    cls_fill: float = option(
        0.875,
        "mean pooling: the exact test applies while the last block's Q-gradient span keeps at most this "
        "fraction of the width (every token's row reaches the loss, so its rank grows with B*T)",
    )
    row_check: bool = option(
        True,
        "peeling: where the last block's span leaves no gap (mean pooling, B*T near the width), test a sentence by "
        "its token-embedding gradient rows instead (span.checks.RowCheck)",
    )
    tol_row: float = option(
        1e-4, "the embedding-row test: relative mismatch of a token's row below which a sentence is exact"
    )
    prior_weight: float = option(0.2, "weight of the position prior where the layer-2 span is crowded")
    mlp_blocks: int = option(
        1,
        "peeling, where the layer-2 span is crowded: search on the first k blocks' MLP down-projection spans (span.mlp; 0: off)",
    )
    mlp_max_fill: float = option(
        0.5,
        "peeling: the MLP objective applies while each MLP down-projection span keeps at most this fraction of its "
        "hidden width (its rank is at most the model's width, a quarter of a 4x MLP)",
    )
    mlp_codim: float = option(
        0.4, "peeling: the MLP objective also where layer 2's span leaves less than this fraction of the width"
    )
    narrow: int = option(8, "peeling sweeps try each position's k likeliest tokens first (0: all at once)")
    prefix_seeds: bool | None = option(
        None,
        "peeling: grow beam prefixes by layer-2 distance and repair them before the walkers (span.prefix); "
        "unset: where the embedding LayerNorm pins at least half of the layer-1 candidate tokens",
    )
    suffix_seeds: bool = option(
        True,
        "peeling on the MLP objective: grow every length's sentence from its end, first where the span is at or "
        "near its rank limit, else after prefix seeds that found none (span.suffix)",
    )
    suffix_near: float = option(
        0.85,
        "peeling on an exact MLP objective: the suffix growth runs before the prefix seeds where the span's rank is "
        "at least this fraction of its limit (span.schedule)",
    )
    suffix_sweeps: int = option(6, "suffix growth: right-to-left sweeps per grown sentence at most")
    suffix_reach: int = option(
        2, "suffix growth: a changed token sends the positions this close to it through the next sweep"
    )
    suffix_local: float = option(
        2.5,
        "suffix growth: the repair sweeps run where a position's cost moves this many times more with the token "
        "before it than with one three before (block 1 reads the previous token)",
    )
    suffix_probes: int = option(8, "suffix growth: positions probed for reading the previous token")
    suffix_alts: int = option(4, "suffix growth: other candidates tried per probed position")
    restarts: int = option(4, "restarts of the encoder assignment search")
    sweeps: int = option(12, "coordinate sweeps per restart of the encoder assignment search")
    budget: int | None = option(
        None,
        "candidate sentences scored, all searches together (counted work, never seconds); "
        "unset: budget_per_sentence x the batch size, at least budget_floor",
    )
    budget_per_sentence: int = option(50_000, "the default budget's candidate sentences per sentence of the batch")
    budget_floor: int = option(100_000, "the default budget's least candidate sentences")
    work: int = option(
        WORK,
        "peeling: block-rows computed per batch sentence (one token through one block; a backward pass counts 2)",
    )
    beam: int | None = option(
        None, "prefixes kept per position by the decoder search; unset: beam_per_sentence x batch size"
    )
    beam_per_sentence: int = option(4, "the decoder search's unset beam: prefixes kept per batch sentence")
    crowded: float = option(
        0.125, "peeling: layer 2's span is crowded where it leaves less than this fraction of the width free"
    )
    cls_weight: float = option(10.0, "peeling, crowded objective: weight of the [CLS] distance in a walker's objective")
    grad_cap: float = option(0.1, "peeling, crowded objective: cap of a position's embedding-gradient mismatch")
    kick: int = option(3, "peeling: positions a walker's kick redraws at a local minimum")
    merit_floor: float = option(
        0.02, "peeling, crowded objective: a walk's merit is its share / max(best objective per position, this)"
    )
    share_floor: float = option(
        0.1, "peeling: a length's work share, this + the position prior's [SEP] coefficient at its last position"
    )
    extend_lengths: tuple[int, ...] = option(
        (-1, 1, 2), "peeling, graded objective: the lengths (offsets) a walk's new lowest best restarts"
    )
    cross_every: int = option(2, "peeling, uncrowded: every this many kicks a walk restarts from another length's best")
    prefix_width: int = option(24, "prefix seeds on layer 2: each position's candidates, the prior's likeliest")
    prefix_beam: int = option(4, "prefix seeds: prefixes kept per step")
    prefix_ends: int = option(2, "prefix seeds: lengths of a grown path repaired (its closest closed sentences)")
    prefix_rounds: int = option(3, "prefix seeds: repair rounds per repaired sentence")
    prefix_worst: int = option(8, "prefix seeds: positions a repair round revisits (the worst by layer-2 distance)")
    prefix_starts: int = option(4, "prefix seeds: first tokens grown per stage beyond the sentences left")
    presence_tol: float = option(
        1e-7, "presence filter: a token is in the bag where its embedding-gradient row norm passes this x the largest"
    )
    ln_slack: float = option(
        1e-3, "LayerNorm pins: the norm's leak along its own input, eps / (var + eps), widens tol_ln only below this"
    )
    pinned_share: float = option(
        0.5, "prefix_seeds unset: seed where the LayerNorm pins at least this share of the layer-1 candidate tokens"
    )
    kick_prior: float = option(0.5, "peeling: share of a walker's kicked positions drawn from the position prior")
    kick_top: int = option(3, "peeling: a kick's prior draw picks among the position's this many best tokens")
    layouts: int = option(6, "encoder assignment search: sentence-length hypotheses tried (shortest first)")
    layout_reach: int = option(
        3, "encoder assignment search: [SEP] positions each sentence's length may take, at or above its bound"
    )
    one_free_weight: float = option(
        1e3,
        "LoRA updates: an adapter span that leaves one free dimension counts its distances this many times over "
        "(a random input passes it within tol1 with probability ~tol1)",
    )
    seed: int | None = option(None, "seed of the searches; unset: the knowledge's seed")

    def sentences(self, batch_size: int) -> int:
        """The sentences-scored budget of a batch of `batch_size`: `budget` where set, else
        `budget_per_sentence` per sentence of the batch and at least `budget_floor`."""
        if self.budget is not None:
            return self.budget
        return max(self.budget_floor, self.budget_per_sentence * max(1, batch_size))


#: the defaults, for the parts of the search built on their own (tests, benchmarks)
DEFAULTS = SpanOptions()
