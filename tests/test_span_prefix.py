"""The prefix seeds of peeling (`veil.attacks.span.prefix`) on the batch where layer 1 narrows
nothing: MiniLM ([CLS] pooling, dropout 0), 8 SST-2 test sentences of 17-32 tokens (218 real
tokens, 142 distinct): layer 1 admits 138 of the 142 bag tokens at every position. The seeds'
first stage rebuilds one of the batch's sentences exactly (the walkers alone: none of the 8
in 100,000 sentences scored, docs/results/bench/span-scale.json)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from veil.attacks import observe
from veil.attacks.harness import knowledge_for, private_batches
from veil.attacks.span.checks import CLSCheck
from veil.attacks.span.core import Specials, position_candidates, vocabulary
from veil.attacks.span.options import DEFAULTS
from veil.attacks.span.peel import setup_stage
from veil.attacks.span.prefix import PrefixSeeds
from veil.attacks.span.residual import Residual
from veil.build import build_run
from veil.config import load_config


@pytest.mark.slow
def test_prefix_seeds_rebuild_a_minilm_batch_8_sentence_where_layer_1_admits_the_whole_bag() -> None:
    torch.set_num_threads(1)
    over = ["model=minilm", "model.dropout=0", "data=sst2", "data.tokenizer=wordpiece", "data.max_len=32"]
    model, data, defenses = build_run(load_config(None, [*over, "data.train_size=64", "model.pooling=cls"]))
    batch = private_batches(data.test, 8, 1, seed=0)[0]
    assert batch["attention_mask"].sum(1).tolist() == [29, 32, 32, 29, 29, 20, 30, 17]
    model.eval()
    obs = observe(model, batch, defenses)
    know = knowledge_for(batch, data, defenses, 0, None)
    vocab = vocabulary(obs, know)
    res = Residual(obs, 8)
    with torch.no_grad():
        cands = position_candidates(model, res.layer_span(0, 1e-6), 32, 1e-3, vocab=vocab)[0]
        assert min(len(c) for c in cands[1:30]) > 0.9 * len(vocab)  # layer 1 narrows nothing
        seeds = PrefixSeeds(Specials.of(model, know), on=True)
        stage = setup_stage(
            res,
            CLSCheck(res),
            lambda span: position_candidates(model, span, 32, 1e-3, vocab=vocab)[0],
            Specials.of(model, know),
            np.random.default_rng(0),
            {},
            DEFAULTS,
            (seeds,),
        )
        # a layer-2 stage: gate 1e-3, the [CLS] test at 1e-4, 8 + 4 first tokens grown
        assert stage.gate == 1e-3 and stage.tol == 1e-4 and stage.left + DEFAULTS.prefix_starts == 12
        hits = seeds.propose(stage, 40_000).hits
    true = [batch["input_ids"][b, : int(n)].tolist() for b, n in enumerate(batch["attention_mask"].sum(1))]
    assert hits and all(h in true for h in hits), (hits, stage.scored)
    assert stage.scored <= 40_000
