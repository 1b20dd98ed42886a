"""Text attacks on tiny real models and real SST-2 sentences: presence, span (DAGER), TAG, LAMP."""

from __future__ import annotations

import pytest
import torch

from veil.attacks import Knowledge, create_attack, list_attacks
from veil.attacks.base import observe
from veil.attacks.presence import true_token_set
from veil.data import load_data
from veil.errors import VeilError
from veil.metrics import presence, text_report
from veil.models import create_model

SPECIAL = {0, 101, 102}


@pytest.fixture(scope="module")
def sst2():
    return load_data("sst2", max_len=24, train_size=300, seed=0)


def _batch(data, B: int, seed: int = 1, max_real: int | None = None) -> dict[str, torch.Tensor]:
    mask = data.train["attention_mask"]
    ok = torch.nonzero(mask.sum(1) <= (max_real or mask.shape[1])).flatten()
    idx = ok[torch.randperm(len(ok), generator=torch.Generator().manual_seed(seed))[:B]]
    return {k: v[idx] for k, v in data.train.items()}


def _refs(batch) -> list[list[int]]:
    return [ids[m.bool()].tolist() for ids, m in zip(batch["input_ids"], batch["attention_mask"])]


def _tiny(name: str, **kw):
    torch.manual_seed(0)
    dims = {"transformer4": dict(dim=96, depth=3), "gpt-tiny": dict(dim=96, depth=3)}[name]
    model = create_model(name, max_len=24, **dims, **kw)
    model.eval()
    return model


def test_registered():
    assert {"presence", "span"} <= set(list_attacks())


def test_presence_f1_is_one_on_untrained_encoder(sst2):
    model = _tiny("transformer4")
    batch = _batch(sst2, 4)
    rec = create_attack("presence").reconstruct(observe(model, batch), Knowledge(tokenizer=sst2.meta["tokenizer"]))
    truth = true_token_set(batch["input_ids"], batch["attention_mask"], SPECIAL)
    assert presence(truth, rec.token_set)["presence_f1"] == 1.0
    assert not (rec.token_set & SPECIAL)


def test_presence_refuses_tied_embedding(sst2):
    model = _tiny("gpt-tiny", tie_weights=True)
    obs = observe(model, _batch(sst2, 1))
    with pytest.raises(VeilError, match="tie"):
        create_attack("presence").reconstruct(obs, Knowledge())


@pytest.mark.parametrize("name,B", [("transformer4", 1), ("transformer4", 2), ("transformer4", 3), ("gpt-tiny", 4)])
def test_span_recovers_batch_exactly(sst2, name, B):
    model = _tiny(name)
    batch = _batch(sst2, B, max_real=14)
    know = Knowledge(batch_size=B, seq_len=24, tokenizer=sst2.meta["tokenizer"])
    rec = create_attack("span").reconstruct(observe(model, batch), know)
    rep = text_report(_refs(batch), rec.token_ids, ignore=SPECIAL)
    assert rep["token_recovery"] == 1.0 and rep["exact_recovery"] == 1.0, (rec.token_ids, rec.stats)


def test_span_without_layer_gradient_says_so(sst2):
    model = _tiny("transformer4")
    obs = observe(model, _batch(sst2, 1))
    q = model.attention_layers()[1].q.weight
    for name in [n for n, p in model.named_parameters() if p is q or n.startswith("blocks.1.attn.")]:
        obs.grads.pop(name, None)
    with pytest.raises(VeilError) as err:
        create_attack("span").reconstruct(obs, Knowledge(batch_size=1, seq_len=24))
    assert "\n" not in str(err.value) and "gradient" in str(err.value)


def test_presence_without_embedding_gradient_says_so(sst2):
    model = _tiny("transformer4")
    obs = observe(model, _batch(sst2, 1))
    obs.grads.pop("tok.weight")
    with pytest.raises(VeilError) as err:
        create_attack("presence").reconstruct(obs, Knowledge())
    assert "\n" not in str(err.value)


# ----------------------------------------------------------------------------- span goals (issue 4)
def _sst2_batch(B: int, max_len: int, seed: int = 1) -> tuple[dict[str, torch.Tensor], object]:
    data = load_data("sst2", max_len=max_len, train_size=400, seed=0)
    idx = torch.randperm(400, generator=torch.Generator().manual_seed(seed))[:B]
    return {k: v[idx] for k, v in data.train.items()}, data.meta["tokenizer"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "name,B,max_len",
    [
        ("transformer4", 1, 32),
        ("transformer4", 4, 32),
        ("minilm", 1, 32),
        ("minilm", 4, 32),
        ("gpt-tiny", 8, 16),
    ],
)
def test_span_goal_cells(name, B, max_len):
    """The issue's goals (position-aware token_recovery >= 0.95, undefended, no dropout). The
    decoder cell uses max_len 16 so that B*T < width 128 (DAGER's rank condition; at max_len 32
    the 8 sentences hold ~130 tokens and the span is full). The encoders find one sentence at a
    time with the last block's [CLS] check and peel it off the gradient, so transformer4 at B=4
    (often > 96 tokens) works at max_len 32."""
    batch, tok = _sst2_batch(B, max_len)
    torch.manual_seed(0)
    model = create_model(name, dropout=0.0) if name == "minilm" else create_model(name, dropout=0.0, max_len=32)
    model.eval()
    rec = create_attack("span", budget=200_000).reconstruct(
        observe(model, batch), Knowledge(batch_size=B, seq_len=max_len, tokenizer=tok)
    )
    rep = text_report(_refs(batch), rec.token_ids, ignore=SPECIAL)
    assert rep["token_recovery"] >= 0.95, (rep, rec.stats)


@pytest.mark.slow
def test_span_goal_wider_decoder_full_sentences():
    """The decoder goal with full 32-token SST-2 sentences: a GPT-2 of width 256 holds the 8
    sentences' tokens below its width (DAGER's rank condition; gpt-tiny's 128 does not)."""
    batch, tok = _sst2_batch(8, 32)
    torch.manual_seed(0)
    model = create_model("hf-gpt2", dim=256, depth=2, max_len=32, dropout=0.0)
    model.eval()
    rec = create_attack("span", budget=100_000).reconstruct(
        observe(model, batch), Knowledge(batch_size=8, seq_len=32, tokenizer=tok)
    )
    rep = text_report(_refs(batch), rec.token_ids, ignore=SPECIAL)
    assert rep["token_recovery"] >= 0.95, (rep, rec.stats)


def test_cls_check_and_peeling(sst2):
    """The last block's Q gradient of a [CLS]-pooled encoder has rank B: a batch sentence lies in its
    row space (a wrong token does not), and subtracting a sentence's own gradient with the
    inferred label leaves rank B - 1 and the right label."""
    from veil.attacks.span.checks import CLSCheck
    from veil.attacks.span.residual import Residual
    from veil.attacks.span.score import SentenceScore

    model = _tiny("transformer4")
    batch = _batch(sst2, 3, max_real=14)
    obs = observe(model, batch)
    res = Residual(obs, 3)
    check = CLSCheck(res)
    assert check.usable
    score = SentenceScore(model, res.layer_span(1, 1e-6), check)
    sents = _refs(batch)
    for s in sents:
        wrong = list(s)
        wrong[1] = 2000 if s[1] != 2000 else 2001
        assert score.cls(torch.tensor([s])) < 1e-4 < score.cls(torch.tensor([wrong]))
    label, ratio = res.peel(sents[0], check)
    assert label == int(batch["labels"][0]) and ratio < 1e-5 and res.left == 2
    after = CLSCheck(res)
    assert after.usable and after.span.rank == 2
    assert SentenceScore(model, res.layer_span(1, 1e-6), after).cls(torch.tensor([sents[0]])) > 1e-2


def test_position_prior_places_once_only_tokens(sst2):
    """Token and position embeddings are summed first, so each position row of the position
    gradient is the sum of the token rows of the once-only tokens there, plus parts of repeated
    tokens' rows: the least-squares coefficient of a once-only token is large (>= 0.5) at its own
    position and highest there for most of them (the repeated tokens' parts blur the rest)."""
    from veil.attacks.span.residual import Residual
    from veil.attacks.span.score import PositionPrior

    model = _tiny("transformer4")
    batch = _batch(sst2, 3, max_real=14)
    prior = PositionPrior(Residual(observe(model, batch), 3), 24)
    sents = _refs(batch)
    counts = torch.bincount(torch.tensor([v for s in sents for v in s]))
    once = [(t, v) for s in sents for t, v in enumerate(s) if counts[v] == 1]
    placed = sum(bool(prior.cost[t, v] < 0.5) for t, v in once)
    best = sum(int(prior.cost[:, v].argmin()) == t for t, v in once)
    assert len(once) >= 15 and placed >= 0.8 * len(once) and best >= 0.8 * len(once), (placed, best, len(once))
    assert float(prior(torch.tensor([sents[0]])).sum()) < float(prior(torch.tensor([sents[0][::-1]])).sum())


def test_span_recovers_batch_beyond_the_width(sst2):
    """More tokens than the width (B*T > 96: four long sentences and a short one): layers 1 and 2
    lose their gap; the [CLS] check, the embedding-gradient match and peeling still rebuild the
    batch exactly (the short sentence first, then the others once it is subtracted)."""
    model = _tiny("transformer4")
    data = load_data("sst2", max_len=24, train_size=300, seed=0)
    mask = data.train["attention_mask"]
    real = mask.sum(1)
    idx = torch.cat([torch.nonzero(real >= 22).flatten()[:4], torch.nonzero(real <= 10).flatten()[:1]])
    batch = {k: v[idx] for k, v in data.train.items()}
    assert int(batch["attention_mask"].sum()) > 96
    know = Knowledge(batch_size=5, seq_len=24, tokenizer=data.meta["tokenizer"])
    # the search takes the same path at any thread count and load (tests/test_span_determinism.py):
    # 11,249 sentences scored at one thread and at two (it was 166k / 54k while float rounding decided)
    rec = create_attack("span", budget=15_000).reconstruct(observe(model, batch), know)
    rep = text_report(_refs(batch), rec.token_ids, ignore=SPECIAL)
    assert rep["token_recovery"] == 1.0, (rep, rec.stats)


@pytest.mark.slow
def test_span_on_a_dropout_client_is_refused_for_span_robust():
    """Dropout (p=0.1) moves the layer inputs off the clean vectors' span, so no token would pass
    layer 1: the attack refuses in one line and names the attack that models the masks."""
    batch, tok = _sst2_batch(1, 32)
    torch.manual_seed(0)
    model = create_model("transformer4", dropout=0.1, max_len=32)
    model.train()
    with pytest.raises(VeilError, match="dropout 0.1: use span-robust"):
        create_attack("span").reconstruct(observe(model, batch), Knowledge(batch_size=1, seq_len=32, tokenizer=tok))


def test_span_search_does_not_depend_on_time(sst2, monkeypatch):
    """The search is ordered and bounded by counted work: a clock that jumps 1000 s at every reading
    (a machine slowed down without bound) changes nothing; the old seconds budget says what
    replaced it."""
    import time as _time

    model = _tiny("transformer4")
    batch = _batch(sst2, 3, max_real=14)
    know = Knowledge(batch_size=3, seq_len=24, tokenizer=sst2.meta["tokenizer"])
    ticks = iter(range(0, 10**9, 1000))
    monkeypatch.setattr(_time, "perf_counter", lambda: float(next(ticks)))
    rec = create_attack("span").reconstruct(observe(model, batch), know)
    assert text_report(_refs(batch), rec.token_ids, ignore=SPECIAL)["exact_recovery"] == 1.0, rec.stats
    with pytest.raises(VeilError, match="unknown option 'budget_s' .did you mean 'budget'.."):
        create_attack("span", budget_s=60).reconstruct(observe(model, batch), know)


# ----------------------------------------------------------------------------- mean pooling (issue 21)
def _mean_pooled_bert() -> object:
    """A small HF BERT classifier fed the masked mean of its last layer (as sentence-transformer
    checkpoints such as the shipped MiniLM are): every token's last-block row reaches the loss."""
    torch.manual_seed(0)
    model = create_model("hf-bert", dim=128, depth=2, heads=4, max_len=24, dropout=0.0)
    model.pooling = "mean"
    model.eval()
    return model


def test_mean_pooled_sentence_check_and_peeling(sst2):
    """Mean pooling: the last block's Q gradient has rank B*T (not B), so the [CLS] test does not
    apply; the all-rows test does: a batch sentence lies in that span at every position, one wrong
    token moves it off, and subtracting the sentence with the inferred label drops the rank by
    its length (the `veil attack configs/minilm_sst2.yaml` case: exact 0.0 before, the search fell
    back to the joint assignment)."""
    from veil.attacks.span.checks import CLSCheck
    from veil.attacks.span.residual import Residual
    from veil.attacks.span.score import SentenceScore

    model = _mean_pooled_bert()
    batch = _batch(sst2, 2, max_real=12)
    res = Residual(observe(model, batch), 2)
    check = CLSCheck(res)
    sents = _refs(batch)
    assert check.usable and check.rows == "all" and check.span.rank == sum(len(s) for s in sents)
    score = SentenceScore(model, res.layer_span(1, 1e-6), check, with_cls=False)
    for s in sents:
        wrong = list(s)
        wrong[2] = 2000 if s[2] != 2000 else 2001
        assert score.cls(torch.tensor([s])) < 1e-4 < 1e-2 < score.cls(torch.tensor([wrong]))
    label, ratio = res.peel(sents[0], check)
    assert label == int(batch["labels"][0]) and ratio < 1e-5
    after = CLSCheck(res)
    assert after.usable and after.span.rank == len(sents[1])


def test_span_recovers_mean_pooled_batch_exactly(sst2):
    """The attack on a mean-pooled encoder peels one exact sentence at a time (it used to fall back
    to the joint assignment search, which did not rebuild any sentence whole on MiniLM)."""
    model = _mean_pooled_bert()
    batch = _batch(sst2, 3, max_real=12)
    know = Knowledge(batch_size=3, seq_len=24, tokenizer=sst2.meta["tokenizer"])
    rec = create_attack("span", budget=50_000).reconstruct(observe(model, batch), know)
    rep = text_report(_refs(batch), rec.token_ids, ignore=SPECIAL)
    assert rec.stats["search"] == "peel" and rec.stats["sentences_exact"] == 3, rec.stats
    assert rep["token_recovery"] == 1.0 and rep["exact_recovery"] == 1.0, (rep, rec.stats)
