"""The tokenizers of veil's text data: MiniLM's WordPiece, a word-level vocabulary, and the
tokenizer of a user's Hugging Face checkpoint folder.

The first two use BERT's special-token slots ([PAD]=0, [UNK]=100, [CLS]=101, [SEP]=102,
[MASK]=103), so a model built for one takes the other's ids. All three encode every text as
``start tokens end pad ...`` at a fixed length (start / end: [CLS] / [SEP], <s> / </s>, or the
BOS / EOS of a decoder's tokenizer).
"""

from __future__ import annotations

import json
import re
import unicodedata
from collections import Counter
from collections.abc import Iterable, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor

from veil.assets import minilm_dir
from veil.errors import VeilError

PAD, UNK, CLS, SEP, MASK = 0, 100, 101, 102, 103
FIRST_WORD_ID = 104
#: a word is letters and digits of any script (with an apostrophe suffix of letters); any other
#: non-space character is a token of its own
WORD_RE = re.compile(r"[^\W_]+(?:'[^\W\d_]+)?|\S")


class Tokenizer(Protocol):
    """What loaders, models and attacks need from a tokenizer."""

    vocab_size: int
    pad_id: int
    cls_id: int
    sep_id: int

    def encode(self, texts: Sequence[str], max_len: int) -> tuple[Tensor, Tensor]: ...

    def decode(self, ids: Sequence[int] | Tensor, skip_special: bool = False) -> list[str]: ...


def check_max_len(max_len: int) -> None:
    """[CLS] and [SEP] need two slots."""
    if max_len < 2:
        raise VeilError(f"max_len must be at least 2 (room for [CLS] and [SEP]), got {max_len}")


def as_id_list(ids: Sequence[int] | Tensor) -> list[int]:
    """A 1-D id sequence as plain ints."""
    if isinstance(ids, Tensor):
        if ids.dim() != 1:
            raise VeilError(f"decode takes one sequence of ids (1-D), got shape {tuple(ids.shape)}")
        return ids.tolist()
    return [int(i) for i in ids]


@lru_cache(maxsize=1)
def _load_bert_tokenizer(folder: str):  # noqa: ANN202 - transformers type
    """Load once per process; it is read-only after loading."""
    from transformers import BertTokenizerFast

    return BertTokenizerFast.from_pretrained(folder, local_files_only=True)


class HFPieces:
    """What a tokenizer backed by a transformers tokenizer (``self._tok``) reads off it."""

    _tok: Any

    def decode(self, ids: Sequence[int] | Tensor, skip_special: bool = False) -> list[str]:
        """The tokenizer's pieces (e.g. WordPiece's '##ing') of one id sequence."""
        tokens = self._tok.convert_ids_to_tokens(as_id_list(ids))
        specials = set(self._tok.all_special_tokens)
        return [t for t in tokens if not (skip_special and t in specials)]

    def vocab(self) -> dict[str, int]:
        """token -> id, to compare with a model's own tokenizer."""
        return dict(self._tok.get_vocab())

    def hf_tokenizer(self) -> Any:
        """The transformers tokenizer (what `veil export --hf` saves beside the model)."""
        return self._tok


class WordPieceTokenizer(HFPieces):
    """MiniLM's uncased WordPiece vocabulary (30,522 ids), read offline from the installed package."""

    def __init__(self) -> None:
        self._tok = _load_bert_tokenizer(str(minilm_dir()))
        self.vocab_size: int = int(self._tok.vocab_size)
        self.pad_id: int = int(self._tok.pad_token_id)
        self.cls_id: int = int(self._tok.cls_token_id)
        self.sep_id: int = int(self._tok.sep_token_id)
        self.unk_id: int = int(self._tok.unk_token_id)
        self.mask_id: int = int(self._tok.mask_token_id)
        self.name = "wordpiece"

    @staticmethod
    def model_dir() -> Path:
        """The local folder a Hugging Face model/tokenizer can be loaded from."""
        return minilm_dir()

    def encode(self, texts: Sequence[str], max_len: int) -> tuple[Tensor, Tensor]:
        """(input_ids, attention_mask), both int64 (N, max_len); long texts are truncated."""
        check_max_len(max_len)
        enc = self._tok(
            list(texts),
            padding="max_length",
            truncation=True,
            max_length=max_len,
            return_tensors="pt",
            return_token_type_ids=False,
        )
        return enc["input_ids"].long(), enc["attention_mask"].long()

    def __repr__(self) -> str:
        return f"WordPieceTokenizer(vocab_size={self.vocab_size})"


class FolderTokenizer(HFPieces):
    """The tokenizer of a Hugging Face checkpoint folder (AutoTokenizer, local files only).

    Texts are laid out as veil's other tokenizers do: start, the text's tokens (no special tokens
    of the tokenizer's own template), end, then padding. Start is [CLS] / <s> / BOS, end [SEP] /
    </s> / EOS; a tokenizer without a padding token pads with its end token (attention_mask 0)."""

    def __init__(self, folder: str | Path) -> None:
        from transformers import AutoTokenizer

        path = Path(folder)
        if not path.is_dir():
            raise VeilError(
                f"data.tokenizer '{folder}' is neither a known tokenizer ({', '.join(TOKENIZERS)}) nor a folder"
            )
        try:
            self._tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError, TypeError) as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise VeilError(
                f"data.tokenizer '{folder}': no usable Hugging Face tokenizer there ({first[:160]})"
            ) from None
        tok = self._tok
        start = tok.cls_token_id if tok.cls_token_id is not None else tok.bos_token_id
        end = tok.sep_token_id if tok.sep_token_id is not None else tok.eos_token_id
        if start is None or end is None:
            raise VeilError(
                f"data.tokenizer '{folder}' has no {'start' if start is None else 'end'} token "
                "(cls_token / bos_token, sep_token / eos_token); set one in its tokenizer_config.json"
            )
        self.cls_id: int = int(start)
        self.sep_id: int = int(end)
        self.pad_id: int = int(tok.pad_token_id) if tok.pad_token_id is not None else self.sep_id
        self.unk_id: int | None = tok.unk_token_id
        self.mask_id: int | None = tok.mask_token_id
        self.vocab_size: int = len(tok)
        self.name = str(path)

    def encode(self, texts: Sequence[str], max_len: int) -> tuple[Tensor, Tensor]:
        """(input_ids, attention_mask), both int64 (N, max_len); long texts are truncated."""
        check_max_len(max_len)
        pieces = self._tok(list(texts), add_special_tokens=False, truncation=True, max_length=max_len - 2)["input_ids"]
        ids = torch.full((len(pieces), max_len), self.pad_id, dtype=torch.int64)
        mask = torch.zeros((len(pieces), max_len), dtype=torch.int64)
        for i, p in enumerate(pieces):
            row = [self.cls_id, *p, self.sep_id]
            ids[i, : len(row)] = torch.tensor(row, dtype=torch.int64)
            mask[i, : len(row)] = 1
        return ids, mask

    def __repr__(self) -> str:
        return f"FolderTokenizer({self.name!r}, vocab_size={self.vocab_size})"


def split_words(text: str) -> list[str]:
    """Lowercased words of any script (NFC, so `café` is one word however it was typed; with a
    simple apostrophe suffix) and single punctuation marks."""
    return WORD_RE.findall(unicodedata.normalize("NFC", text).lower())


def base_vocab() -> list[str]:
    """BERT's reserved slots 0..103: [PAD], [unused0..98], [UNK], [CLS], [SEP], [MASK]."""
    return ["[PAD]"] + [f"[unused{k}]" for k in range(99)] + ["[UNK]", "[CLS]", "[SEP]", "[MASK]"]


class WordTokenizer:
    """A word-level vocabulary built from a corpus; words fill ids from 104 upward."""

    pad_id: int = PAD
    unk_id: int = UNK
    cls_id: int = CLS
    sep_id: int = SEP
    mask_id: int = MASK

    def __init__(self, words: Sequence[str]) -> None:
        self.itos: list[str] = base_vocab() + list(words)
        self.stoi: dict[str, int] = {w: i for i, w in enumerate(self.itos)}
        if len(self.stoi) != len(self.itos):
            raise VeilError("word vocabulary has repeated words")
        self.vocab_size: int = len(self.itos)
        self.name = "word"

    @classmethod
    def build(cls, corpus: Iterable[str], max_vocab: int = 10000, min_freq: int = 1) -> WordTokenizer:
        """Keep the most frequent words (ties by spelling, so builds repeat) that appear at least
        `min_freq` times; `max_vocab` counts all ids, the 104 reserved ones included."""
        if max_vocab <= FIRST_WORD_ID:
            raise VeilError(f"max_vocab must be more than {FIRST_WORD_ID} (the reserved ids), got {max_vocab}")
        counts = Counter(w for text in corpus for w in split_words(text))
        ranked = sorted((w for w, c in counts.items() if c >= min_freq), key=lambda w: (-counts[w], w))
        return cls(ranked[: max_vocab - FIRST_WORD_ID])

    def encode(self, texts: Sequence[str], max_len: int) -> tuple[Tensor, Tensor]:
        """(input_ids, attention_mask), both int64 (N, max_len); long texts are truncated."""
        check_max_len(max_len)
        get = self.stoi.get
        rows = []
        for text in texts:
            seq = [CLS] + [get(w, UNK) for w in split_words(text)[: max_len - 2]] + [SEP]
            rows.append(seq + [PAD] * (max_len - len(seq)))
        ids = torch.tensor(rows, dtype=torch.int64).reshape(len(rows), max_len)
        return ids, (ids != PAD).long()

    def decode(self, ids: Sequence[int] | Tensor, skip_special: bool = False) -> list[str]:
        """The words of one id sequence; ids outside the vocabulary read as [UNK]."""
        out = [self.itos[i] if 0 <= i < self.vocab_size else "[UNK]" for i in as_id_list(ids)]
        return [t for t in out if not (skip_special and t.startswith("[") and t.endswith("]"))]

    def vocab(self) -> dict[str, int]:
        """token -> id, to compare with a model's own tokenizer."""
        return dict(self.stoi)

    def to_json(self, path: str | Path) -> None:
        """Save as JSON (the words after the reserved slots)."""
        blob = {"kind": "word", "version": 1, "words": self.itos[FIRST_WORD_ID:]}
        Path(path).write_text(json.dumps(blob, ensure_ascii=False), encoding="utf-8")

    @classmethod
    def from_json(cls, path: str | Path) -> WordTokenizer:
        """Load what `to_json` saved."""
        p = Path(path)
        if not p.exists():
            raise VeilError(f"tokenizer file {str(p)!r} does not exist")
        try:
            blob = json.loads(p.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise VeilError(f"tokenizer file {str(p)!r} is not valid JSON: {e.msg} (line {e.lineno})") from None
        if not isinstance(blob, dict) or blob.get("kind") != "word" or not isinstance(blob.get("words"), list):
            raise VeilError(f"tokenizer file {str(p)!r} is not a word tokenizer saved by veil")
        return cls(blob["words"])

    def __repr__(self) -> str:
        return f"WordTokenizer(vocab_size={self.vocab_size})"


TOKENIZERS = ("wordpiece", "word")


def make_tokenizer(
    name: str, corpus: Iterable[str] | None = None, max_vocab: int = 10000, min_freq: int = 1
) -> Tokenizer:
    """'wordpiece' (pretrained MiniLM vocabulary), 'word' (built from `corpus`) or a Hugging Face
    checkpoint folder (its tokenizer)."""
    if name == "wordpiece":
        return WordPieceTokenizer()
    if name == "word":
        if corpus is None:
            raise VeilError("the 'word' tokenizer is built from a corpus; pass corpus=")
        return WordTokenizer.build(corpus, max_vocab=max_vocab, min_freq=min_freq)
    if Path(name).is_dir():
        return FolderTokenizer(name)
    raise VeilError(
        f"unknown tokenizer {name!r}; choose one of: {', '.join(TOKENIZERS)}, or a Hugging Face checkpoint folder"
    )
