"""Multiple-choice QA built offline: choose the true continuation of a shipped sentence among 4.

The MJP paper's Table VII fine-tunes BERT-base on SWAG (pick the ending of a video caption among
4); SWAG is not offline here, so `mcqa` builds its analogue from the shipped AG News (or SST-2)
texts, each split on its own:

1. keep the texts of at least ``min_words`` words; cut each at its middle word: the first half is
   the context, the second half the true ending;
2. draw ``choices - 1`` distractor endings from other texts of the same split whose ending has
   the same number of words (a seeded draw; the nearest length when fewer exist), so length
   is no cue;
3. place the true ending at a seeded random slot; the label is that slot.

Each choice is encoded as the pair ``[CLS] context [SEP] ending [SEP] [PAD] ...`` with
``token_type_ids`` 0 on the context and 1 on the ending; the context keeps its last tokens
(those next to the ending) when the pair is longer than ``max_len``. Batches hold
``input_ids`` / ``attention_mask`` / ``token_type_ids`` of shape (N, choices, max_len) and
``labels`` (N,); a multiple-choice model (`veil.models.multiple_choice`) scores every choice and
takes a softmax over them. Chance is 1 / choices.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from veil.data.splits import DataSplits, Limits, loader
from veil.data.text import ASSETS, find_file, read_agnews, read_sst2, take
from veil.data.tokenizers import Tokenizer
from veil.errors import VeilError
from veil.registry import DATASETS

SOURCES = {"agnews": read_agnews, "sst2": read_sst2}


def split_halves(texts: list[str], min_words: int) -> tuple[list[str], list[str]]:
    """(contexts, endings): each text of >= `min_words` words cut at its middle word."""
    ctx, end = [], []
    for t in texts:
        words = t.split()
        if len(words) >= min_words:
            cut = len(words) // 2
            ctx.append(" ".join(words[:cut]))
            end.append(" ".join(words[cut:]))
    return ctx, end


def draw_choices(endings: list[str], choices: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(N, choices) ending indices per item and the (N,) slot of the true one. Distractors come
    from other items whose ending has the same word count (the nearest counts when too few)."""
    n = len(endings)
    if n < choices:
        raise VeilError(f"mcqa needs at least {choices} texts per split to draw distractors, got {n}")
    rng = np.random.default_rng(seed)
    lengths = np.array([len(e.split()) for e in endings])
    order = np.argsort(lengths + rng.random(n) * 0.5, kind="stable")  # by length, random among equals
    rank = np.empty(n, dtype=np.int64)
    rank[order] = np.arange(n)
    window = max(4 * choices, 16)  # neighbours in length order
    out = np.empty((n, choices), dtype=np.int64)
    labels = rng.integers(0, choices, size=n)
    for i in range(n):
        lo = min(max(rank[i] - window // 2, 0), n - window) if n > window else 0
        pool = order[lo : lo + window]
        same = pool[(lengths[pool] == lengths[i]) & (pool != i)]
        near = pool[(lengths[pool] != lengths[i]) & (pool != i)]
        near = near[np.argsort(np.abs(lengths[near] - lengths[i]), kind="stable")]
        picks = rng.permutation(same)[: choices - 1]
        if len(picks) < choices - 1:
            picks = np.concatenate([picks, near[: choices - 1 - len(picks)]])
        row = np.insert(picks, labels[i], i)
        out[i] = row
    return out, labels


def encode_pairs(
    tok: Tokenizer, first: list[str], second: list[str], pairs: np.ndarray, max_len: int
) -> dict[str, torch.Tensor]:
    """``[CLS] first[i] [SEP] second[j] [SEP]`` for every (i, j) row of `pairs`: int64 (P, max_len)
    ids / mask / token types (each text is tokenized once)."""
    if max_len < 8:
        raise VeilError(f"mcqa max_len must be at least 8, got {max_len}")
    a_ids, a_mask = tok.encode(first, max_len)
    b_ids, b_mask = tok.encode(second, max_len)
    a_tok = [a_ids[i, 1 : n - 1].tolist() for i, n in enumerate(a_mask.sum(1).tolist())]  # without [CLS] / [SEP]
    b_tok = [b_ids[i, 1 : n - 1].tolist() for i, n in enumerate(b_mask.sum(1).tolist())]
    p = len(pairs)
    ids = np.full((p, max_len), tok.pad_id, dtype=np.int64)
    types = np.zeros((p, max_len), dtype=np.int64)
    mask = np.zeros((p, max_len), dtype=np.int64)
    room = max_len - 3
    for r, (i, j) in enumerate(pairs.tolist()):
        a, b = a_tok[i], b_tok[j]
        keep_b = min(len(b), max(room - len(a), room // 2))
        keep_a = min(len(a), room - keep_b)
        row = [tok.cls_id, *a[len(a) - keep_a :], tok.sep_id, *b[:keep_b], tok.sep_id]  # context end meets ending
        ids[r, : len(row)] = row
        mask[r, : len(row)] = 1
        types[r, keep_a + 2 : len(row)] = 1
    return {
        k: torch.from_numpy(v) for k, v in (("input_ids", ids), ("attention_mask", mask), ("token_type_ids", types))
    }


def build_split(
    texts: list[str], tok: Tokenizer, choices: int, max_len: int, min_words: int, seed: int
) -> tuple[dict[str, torch.Tensor], list[dict[str, object]]]:
    """One split's (N, choices, max_len) tensors, its labels, and the items as text."""
    ctx, end = split_halves(texts, min_words)
    picks, labels = draw_choices(end, choices, seed)
    pairs = np.stack([np.repeat(np.arange(len(ctx)), choices), picks.reshape(-1)], axis=1)
    enc = encode_pairs(tok, ctx, end, pairs, max_len)
    split = {k: v.view(len(ctx), choices, max_len) for k, v in enc.items()}
    split["labels"] = torch.as_tensor(labels, dtype=torch.int64)
    items = [{"context": c, "endings": [end[j] for j in row], "label": int(y)} for c, row, y in zip(ctx, picks, labels)]
    return split, items


@dataclass(frozen=True, kw_only=True)
class MCQAOptions(Limits):
    """The options of the multiple-choice set.

    source: the shipped text set the items are cut from ('agnews' or 'sst2').
    tokenizer: 'wordpiece' only (the shipped vocabulary).
    max_len: tokens per context + ending, [CLS] and [SEP] included.
    choices: endings per item, the true one among them.
    min_words: fewest words a text needs to be split into context and ending.
    """

    source: str = "agnews"
    tokenizer: str = "wordpiece"
    max_len: int = 64
    choices: int = 4
    min_words: int = 8


@DATASETS.register("mcqa", help="multiple-choice QA built offline: the true continuation of a shipped text among 4")
@loader(MCQAOptions)
def mcqa(o: MCQAOptions) -> DataSplits:
    """Choose the true second half of a shipped AG News / SST-2 text among `choices` (the rest
    drawn from other texts of the same split with equal word counts; see the module docstring)."""
    source, tokenizer, max_len, choices, min_words = o.source, o.tokenizer, o.max_len, o.choices, o.min_words
    train_size, test_size, seed = o.train_size, o.test_size, o.seed
    if source not in SOURCES:
        raise VeilError(f"mcqa source must be one of: {', '.join(SOURCES)}; got {source!r}")
    if isinstance(choices, bool) or int(choices) != choices or choices < 2:
        raise VeilError(f"mcqa choices must be an integer >= 2, got {choices!r}")
    if tokenizer != "wordpiece":
        raise VeilError(f"mcqa uses the shipped WordPiece vocabulary; tokenizer must be 'wordpiece', got {tokenizer!r}")
    from veil.data.tokenizers import make_tokenizer

    tok = make_tokenizer("wordpiece", [], 0)
    folder = ASSETS / source
    read = SOURCES[source]
    raw = {s: read(find_file(folder, ["train"] if s == "train" else ["test"], source))[0] for s in ("train", "test")}
    splits, items = {}, {}
    for k, s in enumerate(("train", "test")):
        splits[s], items[s] = build_split(raw[s], tok, int(choices), max_len, min_words, seed + k)
        size = train_size if s == "train" else test_size
        pick = take(len(items[s]), size, seed + k, f"{s}_size")
        splits[s] = {key: v[torch.as_tensor(pick)] for key, v in splits[s].items()}
        items[s] = [items[s][i] for i in pick]
    meta = {
        "source": f"veil assets ({source} subset), split into context / ending, {choices} choices",
        "tokenizer": tok,
        "tokenizer_name": "wordpiece",
        "vocab_size": tok.vocab_size,
        "max_len": max_len,
        "special_ids": [tok.pad_id, tok.cls_id, tok.sep_id],
        "choices": int(choices),
        "items": items,
    }
    names = [f"choice {i}" for i in range(int(choices))]
    return DataSplits(splits["train"], splits["test"], int(choices), names, "text", meta)
