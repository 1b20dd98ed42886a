"""span-mjp: the DAGER span attack (Petrov et al. 2024) made aware of MJP's text defense (Ye et
al., "Masked Jigsaw Puzzle", `mjp-masked-jigsaw-puzzle.txt`, Alg. 1 and Eq. 2-3, 6), with an
n-gram word-order prior from public text.

MJP (Eq. 6) selects a ratio gamma of the movable slots of each n-gram window of `window` slots,
permutes the selected tokens among the selected slots of their window, and gives every selected
slot the one learnable position embedding ``E_unk`` instead of ``E_pos[t]``:

    z0[t] = E_tok[x[perm[t]]] + (E_unk if t selected else E_pos[t])   (+ segment, LayerNorm).

What the attacker (the server) knows: the weights it sent, ``E_unk`` (= ``model.mjp.unk``)
included; the exported gradients of one client step; the batch size and padded length; the
public tokenizer; and MJP's settings from ``Knowledge.defense["mjp"]`` (`MJP.describe()`: gamma,
window, variant). Not the shuffle, the mask, the labels or the batch. Public text for the
word-order prior: a corpus the attacker holds (``corpus``, default the shipped SST-2 train file:
8,000 GLUE SST-2 train sentences; veil attacks the test split, GLUE's SST-2 dev, which shares no
sentence with it), tokenized with the public tokenizer.

What it uses:

1. Selected slots. ``E_pos[t]`` does not enter the forward pass where slot t is selected, so row t
   of ``dL/dE_pos`` is exactly zero there, non-zero at every real unselected slot (and zero at
   padding). At batch 1 the selected slots are the zero rows before the last non-zero one ([SEP],
   never moved). (At batch B a row is zero only where all B sentences selected the slot; slots
   selected in some sentences only keep ``E_pos`` here and their tokens then match no position:
   the attack is built for batch 1.)
2. The span test with ``E_unk``: the inputs of the first attention layer are
   ``h0(v, t) = N0(E_tok[v] + p_t)`` with ``p_t = E_unk`` at selected slots, so the plain span
   attack (`veil.attacks.span`: layer-1 test ``d(h0) < tol1``, layer-2 search, [CLS] check) run
   on a position table with ``E_unk`` written into the selected rows recovers the unselected tokens
   at their positions and the selected tokens as a multiset (the layer-2 search fixes their
   counts) - exactly, as DAGER recovers an undefended batch.
3. Nothing in the gradient orders the selected tokens: they all carry ``E_unk``, and attention is
   permutation-equivariant, so every order of them among the selected slots (across windows too)
   gives the same gradient. The window does not constrain it either (which selected tokens share
   a window is hidden). The order is taken from a word-order prior: a token n-gram model
   (`veil.attacks.ngram`, interpolated Kneser-Ney, ``order`` 3) of the public corpus fills the
   selected slots, around the recovered unselected tokens, by beam search (``beam``).

What it recovers at batch 1: docs/results.md (`configs/paper/adaptive_text.yaml`).

Without MJP (no ``mjp`` in the knowledge, gamma 0, a model without ``E_unk``, or the ``shuffle`` /
``nope`` variants, which have no ``E_unk``) the attack is the plain span attack and says so in its
stats. veil's MJP refuses causal LMs, so on decoders span-mjp is the span attack.

Options (`SpanMJPOptions`): ``corpus`` (``sst2-train``, ``agnews-train``, or ``none`` for no
reordering), ``corpus_len`` (tokens kept per public sentence), ``order``, ``discount``, ``beam`` (the
reordering's), ``zero_tol`` (relative norm of a zero position-gradient row); every other option is
the span attack's and goes to it.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from veil.attacks import ATTACKS
from veil.attacks.base import Attack, Knowledge, Observation, Reconstruction
from veil.attacks.ngram import NGram, order_bag
from veil.attacks.options import option
from veil.attacks.span.attack import SpanAttack, SpanOptions
from veil.attacks.span.core import span_reads
from veil.data.tokenizers import Tokenizer
from veil.errors import VeilError
from veil.models.base import VeilModel

CORPORA = ("sst2-train", "agnews-train", "none")
_LM_CACHE: weakref.WeakKeyDictionary[Tokenizer, dict[tuple[str, int, float, int], NGram]] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class SpanMJPOptions(SpanOptions):
    corpus: Literal["sst2-train", "agnews-train", "none"] = option(
        "sst2-train", "public text of the n-gram word-order prior (none: no reordering)"
    )
    corpus_len: int = option(128, "tokens kept of each public sentence the n-gram prior is counted on")
    order: int = option(3, "n-gram order of the word-order prior")
    discount: float = option(0.75, "Kneser-Ney discount of the n-gram model")
    beam: int | None = option(
        256, "beam of the n-gram reordering of the shuffled tokens (not the span search's); unset: the default's"
    )
    zero_tol: float = option(1e-12, "relative norm below which a position-gradient row is zero (an E_unk slot)")


#: SpanMJPOptions' own fields (beam: the reordering's); the others go to the span attack
OWN = frozenset({"corpus", "corpus_len", "order", "discount", "beam", "zero_tol"})
DEFAULTS = SpanMJPOptions()


def selected_slots(obs: Observation, zero_tol: float = DEFAULTS.zero_tol) -> tuple[Tensor, int]:
    """(T,) bool of the slots MJP gave ``E_unk`` (zero rows of the position-table gradient before
    the last non-zero row), and the sentence length (last non-zero row + 1)."""
    model = obs.model
    g = obs.grad(model.position_table()).detach().double()
    norms = g.reshape(-1, g.shape[-1]).norm(dim=1)
    top = float(norms.max()) if norms.numel() else 0.0
    live = norms > zero_tol * top if top > 0 else torch.zeros_like(norms, dtype=torch.bool)
    if not bool(live.any()):
        raise VeilError("span-mjp: the position-table gradient is all zero; no slot to attack")
    n = int(torch.nonzero(live).flatten()[-1]) + 1
    sel = ~live
    sel[n:] = False
    return sel, n


@contextmanager
def unk_at(model: VeilModel, selected: Tensor, unk: Tensor) -> Iterator[None]:
    """Write ``E_unk`` into the selected rows of the position table (restored on exit)."""
    table = model.position_table()
    flat = table.data.reshape(-1, table.shape[-1])
    rows = torch.nonzero(selected).flatten()
    saved = flat[rows].clone()
    with torch.no_grad():
        flat[rows] = unk.detach().reshape(1, -1).to(flat.dtype)
    try:
        yield
    finally:
        with torch.no_grad():
            flat[rows] = saved


def public_text(name: str) -> list[str]:
    """The attacker's public corpus: the shipped train file of SST-2 or AG News."""
    from veil.data.text import ASSETS, find_file, read_agnews, read_sst2

    if name == "sst2-train":
        return read_sst2(find_file(ASSETS / "sst2", ["train"], "sst2"))[0]
    if name == "agnews-train":
        return read_agnews(find_file(ASSETS / "agnews", ["train"], "agnews"))[0]
    raise VeilError(f"span-mjp corpus {name!r} is not known; choose one of: {', '.join(CORPORA)}")


def public_ngram(
    name: str,
    tokenizer: Tokenizer,
    order: int = DEFAULTS.order,
    discount: float = DEFAULTS.discount,
    max_len: int = DEFAULTS.corpus_len,
) -> NGram:
    """The n-gram model of corpus `name` in `tokenizer`'s ids, each sentence cut at `max_len`
    tokens (cached while the tokenizer lives)."""
    cache = _LM_CACHE.setdefault(tokenizer, {})
    key = (name, order, discount, max_len)
    if key not in cache:
        ids, mask = tokenizer.encode(public_text(name), max_len)
        sents = [row[m.bool()].tolist() for row, m in zip(ids, mask)]
        cache[key] = NGram(sents, tokenizer.vocab_size, bos=tokenizer.cls_id, order=order, discount=discount)
    return cache[key]


def reorder(lm: NGram, sentence: list[int], selected: Tensor, beam: int) -> tuple[list[int], float]:
    """Re-place the tokens at the selected slots of `sentence` by the n-gram prior."""
    sel = selected[: len(sentence)].tolist() + [False] * max(0, len(sentence) - len(selected))
    template = [None if s else v for v, s in zip(sentence, sel)]
    bag = [v for v, s in zip(sentence, sel) if s]
    return order_bag(lm, template, bag, beam=beam)


@ATTACKS.register(
    "span-mjp", help="span attack with E_unk at MJP's masked slots; n-gram order of the shuffled words (text)"
)
class SpanMJPAttack(Attack[SpanMJPOptions]):
    """The span attack with E_unk at MJP's selected slots (options: `SpanMJPOptions`; the span
    attack's go to it; see the module docstring for what the attacker knows)."""

    modality = "text"
    observes = frozenset({"gradient", "delta"})
    dropout_breaks = SpanAttack.dropout_breaks
    knows = (
        "the update, the weights (E_unk included), batch size, length and tokenizer, MJP's settings (Knowledge.defense: "
        "gamma, window, variant) and public text (SST-2 train) for an n-gram word-order prior"
    )

    def applies_to(self, model: VeilModel) -> str | None:
        return self._span().applies_to(model)

    def budget(self) -> dict[str, int]:
        """The span attack's (`SpanAttack.budget`): the n-gram reordering's work is fixed by `beam`."""
        return self._span().budget()

    def _span(self) -> SpanAttack:
        return SpanAttack(**{k: v for k, v in self.settings.items() if k not in OWN})

    def reads(self, model: VeilModel) -> list[str]:
        """The first two attention layers' Q/K/V and the last one's Q, the token embedding (its
        bag) and the position table, and the down-projections the peeling search scores with."""
        return span_reads(model)

    def _reconstruct(self, obs: Observation, know: Knowledge) -> Reconstruction:
        o = self.options
        corpus = o.corpus
        mjp = know.defense.get("mjp") or {}
        unk = getattr(getattr(obs.model, "mjp", None), "unk", None)
        why = _not_applied(mjp, unk)
        if why:
            rec = self._span()._reconstruct(obs, know)
            rec.stats["mjp"] = why
            return rec
        selected, n = selected_slots(obs, o.zero_tol)
        with unk_at(obs.model, selected, unk):
            rec = self._span()._reconstruct(obs, know)
        stats = {
            "mjp": "E_unk at the zero rows of the position gradient",
            "selected_slots": torch.nonzero(selected).flatten().tolist(),
            "length": n,
            "gamma": mjp.get("gamma"),
            "window": mjp.get("window"),
            "corpus": corpus,
        }
        if (know.batch_size or 1) > 1:
            stats["note"] = (
                "batch > 1: only slots every sentence shuffled are known; the others' shuffled tokens match no position"
            )
        if corpus != "none" and know.tokenizer is not None and rec.token_ids:
            lm = public_ngram(corpus, know.tokenizer, o.order, o.discount, o.corpus_len)
            beam = int(o.beam or DEFAULTS.beam)  # type: ignore[arg-type]  # the default is set
            out = [reorder(lm, list(seq), selected, beam) for seq in rec.token_ids]
            rec.token_ids = [o[0] for o in out]
            stats.update(ngram_sentences=lm.sentences, ngram_logprob=[round(o[1], 2) for o in out])
        elif corpus != "none":
            stats["ngram"] = "no tokenizer in the knowledge: selected tokens left in the search's order"
        rec.stats.update(stats)
        return rec


def _not_applied(mjp: dict[str, Any], unk: Tensor | None) -> str | None:
    """Why MJP's E_unk cannot be used (None when it can); `mjp`: MJP's `describe()` record from
    `Knowledge.defense` (free-form, as every defense's)."""
    if not mjp:
        return "no MJP in the knowledge: plain span attack"
    if not mjp.get("gamma"):
        return "MJP gamma 0: nothing shuffled, plain span attack"
    if mjp.get("variant", "mjp") != "mjp" or unk is None:
        return f"MJP variant {mjp.get('variant')!r} has no E_unk: plain span attack"
    return None
