"""The span attack's search is deterministic: its decisions do not depend on float rounding that
changes with the thread count or the machine's load (`veil.attacks.span.walker`), and its budget
is counted work, so an idle run at one thread and a run at two threads while two other processes
load both cores take the same path: the same sentences, the same work."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from veil.attacks import Knowledge, create_attack, observe
from veil.attacks.span.walker import margin, pick
from veil.data import load_data
from veil.models import create_model


@pytest.fixture(scope="module")
def sst2():
    return load_data("sst2", max_len=24, train_size=300, seed=0)


def _model():
    torch.manual_seed(0)
    model = create_model("transformer4", max_len=24, dim=96, depth=3)
    model.eval()
    return model


def _batch(data, B: int, max_real: int, seed: int = 1) -> dict[str, torch.Tensor]:
    mask = data.train["attention_mask"]
    ok = torch.nonzero(mask.sum(1) <= max_real).flatten()
    idx = ok[torch.randperm(len(ok), generator=torch.Generator().manual_seed(seed))[:B]]
    return {k: v[idx] for k, v in data.train.items()}


def _attack(model, batch, know, threads: int, **options):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        rec = create_attack("span", **options).reconstruct(observe(model, batch), know)
    finally:
        torch.set_num_threads(before)
    return rec.token_ids, {k: rec.stats[k] for k in ("sentences_scored", "walker_steps", "sentences_exact")}


def test_pick_ignores_rounding_and_breaks_ties_in_order() -> None:
    f = torch.tensor([1.0 + 1e-6, 1.0 - 1e-6, 1.0])  # the current sentence re-scored, off in its last bits
    assert pick(f, 1.0) is None
    f = torch.tensor([0.9, 0.5, 0.5 * (1 + 1e-7), 0.5 * (1 - 1e-7)])  # three equal bests up to rounding
    assert pick(f, 1.0) == 1
    assert pick(torch.tensor([0.7]), 1.0) == 0 and margin(1e-3) == margin(1.0) < 1e-3


def _loaded(fn, burners: int = 2):
    """`fn()` while `burners` other processes spin on the CPU."""
    load = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(burners)]
    try:
        return fn()
    finally:
        for p in load:
            p.kill()
            p.wait()


def test_span_search_is_the_same_under_load(sst2) -> None:
    """Idle, and while two other processes load both cores: the same sentences and the same work."""
    model = _model()
    batch = _batch(sst2, 3, max_real=18)
    know = Knowledge(batch_size=3, seq_len=24, tokenizer=sst2.meta["tokenizer"])
    idle = _attack(model, batch, know, threads=1)
    assert _loaded(lambda: _attack(model, batch, know, threads=1)) == idle
    # the growth (run after prefix seeds that found none, layer 2 included) finds all three
    assert idle[1]["sentences_scored"] > 0 and idle[1]["sentences_exact"] == 3
    # without it, the walkers: their decisions compared the same way
    idle = _attack(model, batch, know, threads=1, suffix_seeds=False)
    assert _loaded(lambda: _attack(model, batch, know, threads=1, suffix_seeds=False)) == idle
    assert idle[1]["walker_steps"] > 0  # the peeling search ran (its decisions are what is compared)


@pytest.mark.slow
def test_span_search_is_the_same_at_two_threads_under_load(sst2) -> None:
    """The batch of test_span_recovers_batch_beyond_the_width (B*T > width: the crowded search, where
    float rounding used to decide: 166k sentences scored at one thread, 54k at two), at one thread
    idle and at two threads under load: the same sentences and the same work."""
    model = _model()
    real = sst2.train["attention_mask"].sum(1)
    idx = torch.cat([torch.nonzero(real >= 22).flatten()[:4], torch.nonzero(real <= 10).flatten()[:1]])
    batch = {k: v[idx] for k, v in sst2.train.items()}
    know = Knowledge(batch_size=5, seq_len=24, tokenizer=sst2.meta["tokenizer"])
    idle = _attack(model, batch, know, threads=1)
    assert _loaded(lambda: _attack(model, batch, know, threads=2)) == idle
    assert idle[1]["sentences_exact"] == 5
