"""span-mjp (DAGER + E_unk against MJP's text defense), its n-gram orderer, and the text scores
that say what leaks (bag of words, unshuffled tokens in place, moved tokens)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from veil.attacks import Knowledge, create_attack
from veil.attacks.base import Reconstruction
from veil.attacks.harness import attack_once, score
from veil.attacks.ngram import NGram, order_bag
from veil.data import load_data
from veil.defenses.mjp import MJP
from veil.errors import VeilError
from veil.metrics import MetricInputError, text_report

SPECIAL = {0, 101, 102}


@pytest.fixture(scope="module")
def sst2():
    return load_data("sst2", max_len=24, train_size=64, test_size=100, seed=0)


def _mjp_model(gamma: float = 0.5, window: int = 8):
    from veil.models import create_model

    torch.manual_seed(0)
    model = create_model("transformer4", max_len=24, dim=96, depth=3, dropout=0.0)
    defense = MJP(gamma=gamma, window=window, aux="none")
    defense.attach(model)
    model.train()  # the client's step: MJP shuffles only in training mode
    return model, defense


def _one(data, index: int) -> dict[str, torch.Tensor]:
    return {k: v[index : index + 1] for k, v in data.test.items()}


@pytest.mark.parametrize("index", [3, 7])
def test_span_mjp_recovers_unshuffled_tokens_in_place_and_shuffled_words_as_a_set(sst2, index):
    """Batch 1, random transformer4 under MJP (gamma 0.5, window 8): every token at a slot MJP did
    not select comes back at its own position, and the selected slots hold exactly the selected
    tokens (as a multiset), whatever order the n-gram prior gives them."""
    model, defense = _mjp_model()
    batch = _one(sst2, index)
    torch.manual_seed(index)
    rec, ref, _ = attack_once(create_attack("span-mjp"), model, batch, [defense], sst2, "original", seed=index)
    n = int(batch["attention_mask"].sum())
    truth = batch["input_ids"][0, :n].tolist()
    selected = defense.last.mask[0, :n]
    assert int(selected.sum()) >= 2, "the case must shuffle something"
    assert rec.stats["selected_slots"] == torch.nonzero(selected).flatten().tolist()
    got = rec.token_ids[0]
    assert len(got) == n
    keep = (~selected).tolist()
    assert [g for g, k in zip(got, keep) if k] == [t for t, k in zip(truth, keep) if k]
    assert Counter(g for g, k in zip(got, keep) if not k) == Counter(t for t, k in zip(truth, keep) if not k)
    m = score(rec, ref, sst2)
    assert m["bag_recall"] == 1.0 and m["bag_precision"] == 1.0 and m["rouge1"] == 1.0
    assert m["moved_tokens"] >= 1 and m["unshuffled_recovery"] == 1.0


def test_span_mjp_beats_span_in_place(sst2):
    """The naive span attack finds no position for a shuffled token (E_pos is not in its input):
    span-mjp recovers strictly more tokens at their positions on the same update."""
    model, defense = _mjp_model()
    batch = _one(sst2, 3)
    out = {}
    for name in ("span", "span-mjp"):
        torch.manual_seed(3)
        rec, ref, _ = attack_once(create_attack(name), model, batch, [defense], sst2, "original", seed=3)
        out[name] = score(rec, ref, sst2)
    assert out["span-mjp"]["token_recovery"] > out["span"]["token_recovery"]
    assert out["span-mjp"]["bag_recall"] > out["span"]["bag_recall"]


def test_span_mjp_without_mjp_is_the_span_attack(sst2):
    from veil.attacks.base import observe
    from veil.models import create_model

    torch.manual_seed(0)
    model = create_model("transformer4", max_len=24, dim=96, depth=3, dropout=0.0).eval()
    batch = _one(sst2, 3)
    know = Knowledge(batch_size=1, seq_len=24, tokenizer=sst2.meta["tokenizer"])
    rec = create_attack("span-mjp").reconstruct(observe(model, batch), know)
    n = int(batch["attention_mask"].sum())
    assert rec.token_ids == [batch["input_ids"][0, :n].tolist()]
    assert "plain span attack" in rec.stats["mjp"]


def test_span_mjp_bad_corpus_says_so(sst2):
    model, defense = _mjp_model()
    with pytest.raises(
        VeilError, match="span-mjp: option 'corpus' must be one of 'sst2-train', 'agnews-train', 'none', got 'wiki'"
    ):
        attack_once(create_attack("span-mjp", corpus="wiki"), model, _one(sst2, 3), [defense], sst2, "original", seed=0)


# ----------------------------------------------------------------------------- the n-gram orderer
def test_ngram_orderer_puts_a_known_phrase_in_order():
    the, movie, was, really, good, bad, cls, sep = 10, 11, 12, 13, 14, 15, 101, 102
    corpus = [[cls, the, movie, was, really, good, sep]] * 3 + [
        [cls, the, movie, was, bad, sep],
        [cls, really, bad, sep],
    ]
    lm = NGram(corpus, vocab_size=200, bos=cls, order=3)
    template = [cls, None, None, None, None, None, sep]
    got, logp = order_bag(lm, template, [good, really, the, was, movie], beam=16)
    assert got == [cls, the, movie, was, really, good, sep]
    worse, worse_logp = order_bag(lm, [cls, good, really, the, was, movie, sep], [], beam=16)
    assert logp > worse_logp and worse == [cls, good, really, the, was, movie, sep]
    fixed, _logp = order_bag(lm, [cls, the, None, was, None, good, sep], [really, movie], beam=16)
    assert fixed == [cls, the, movie, was, really, good, sep]  # fixed tokens stay where they are


def test_ngram_bad_input_says_so():
    with pytest.raises(VeilError, match="2 free slots but 1 tokens"):
        order_bag(NGram([[1, 2]], 10, bos=1), [1, None, None], [2])
    with pytest.raises(VeilError, match="order must be >= 2"):
        NGram([[1, 2]], 10, bos=1, order=1)


# ----------------------------------------------------------------------------- scores
def test_text_scores_on_a_constructed_case():
    """Two sentences, the second with its tokens 6 and 7 swapped by the shuffle; the hyp keeps
    the shuffled order and drops a word of the first sentence."""
    refs = [[101, 5, 6, 7, 8, 102], [101, 9, 9, 102]]
    hyps = [[101, 9, 9, 102], [101, 5, 7, 6, 3, 102]]  # in the other order: Hungarian pairs them back
    moved = [[False, False, True, True, False, False], [False, False, False, False]]
    r = text_report(refs, hyps, ignore=SPECIAL, moved=moved)  # no selection record: the moved slots stand in
    # words (no specials): refs {5,6,7,8,9,9} (6), hyps {9,9,5,7,6,3} (6): common 5 -> 5/6 both ways
    assert r["bag_recall"] == pytest.approx(5 / 6) and r["bag_precision"] == pytest.approx(5 / 6)
    # in place: sentence 1 hits 5 (not 6, 7, 8), sentence 2 hits both 9s: 3 of 6
    assert r["token_recovery"] == pytest.approx(3 / 6)
    # unmoved tokens: 5, 8, 9, 9 -> hits 5, 9, 9 = 3 of 4; moved: 6 and 7
    assert r["unshuffled_recovery"] == pytest.approx(3 / 4) and r["moved_tokens"] == 2.0
    assert r["exact_recovery"] == 0.5
    selected = [moved[0], [False, True, False, False]]  # the shuffle also selected a 9 but left it in place
    r = text_report(refs, hyps, ignore=SPECIAL, moved=moved, shuffled=selected)
    assert r["unshuffled_recovery"] == pytest.approx(2 / 3) and r["moved_tokens"] == 2.0  # 5, 9 of 5, 8, 9
    plain = text_report(refs, hyps, ignore=SPECIAL)
    assert plain["moved_tokens"] == 0.0 and plain["unshuffled_recovery"] == plain["token_recovery"]
    with pytest.raises(MetricInputError, match=r"moved\[1\] has 3 entries for a reference of 4 tokens"):
        text_report(refs, hyps, moved=[moved[0], [False] * 3])


def test_harness_scores_every_text_attack_with_the_bag_and_the_moved_tokens(sst2):
    """`score` on a ref that carries the shuffle record: the bag keys, presence from the sentences
    when the attack returns no token set, and the moved count."""
    ids = torch.tensor([[101, 5, 6, 7, 102, 0]])
    ref = {
        "input_ids": ids,
        "attention_mask": (ids != 0).long(),
        "labels": torch.tensor([1]),
        "moved": torch.tensor([[False, True, True, False, False, False]]),
    }
    m = score(Reconstruction(token_ids=[[101, 6, 5, 7, 102]]), ref, sst2)
    assert m["token_recovery"] == pytest.approx(1 / 3) and m["unshuffled_recovery"] == 1.0 and m["moved_tokens"] == 2.0
    assert m["bag_recall"] == 1.0 and m["presence_f1"] == 1.0 and m["rouge1"] == 1.0 and m["exact_recovery"] == 0.0
    # MJP selected slot 3 too, but its token stayed: shuffled (its position hidden), not moved
    ref["shuffled"] = torch.tensor([[False, True, True, True, False, False]])
    m = score(Reconstruction(token_ids=[[101, 6, 5, 9, 102]]), ref, sst2)
    assert m["moved_tokens"] == 2.0 and m["unshuffled_recovery"] == 0.0 and m["token_recovery"] == 0.0
    assert m["bag_recall"] == pytest.approx(2 / 3) and m["bag_precision"] == pytest.approx(2 / 3)


def test_public_corpus_shares_no_sentence_with_the_attacked_split():
    """The attacker's default public text (the shipped SST-2 train file) holds no test sentence (the
    attacked split), and no sentence of one split of 8 words or more lies inside a sentence of the
    other. (GLUE's train rows include phrases: 5 of them, 5-7 words, stock phrases such as "one of
    the year 's best films", occur inside test sentences; 2 test rows, "bad ." and "very bad .",
    occur inside train sentences: word-order knowledge, not the client's sentences.)"""
    from veil.attacks.span.mjp import public_text
    from veil.data.text import ASSETS, find_file, read_sst2

    def norm(s: str) -> str:
        return " ".join(s.lower().split())

    train = {norm(s) for s in public_text("sst2-train")}
    test = [norm(s) for s in read_sst2(find_file(ASSETS / "sst2", ["test"], "sst2"))[0]]
    assert len(train) > 7000 and len(test) == 872 and not train & set(test)
    joined, tests = "\n".join(train), "\n".join(test)
    assert not [t for t in test if len(t.split()) >= 8 and t in joined]
    assert not [s for s in train if len(s.split()) >= 8 and s in tests]
