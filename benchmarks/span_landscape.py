"""The span attack's graded objective at MiniLM batch 16 (issue 21): why the peeling search stops
there, measured on the objective itself, no search.

One client step of MiniLM ([CLS] pooling, dropout 0) on 16 SST-2 test sentences of up to 32
WordPiece tokens (420 tokens: the layer-2 and MLP-down spans are full), the sentences of the
`--peel` lengths subtracted from the gradient as the search would (`Residual.peel`). For each
remaining sentence (the shortest `--sentences`): its MLP-down cost per position
(`veil.attacks.span.mlp.MLPScore`), the same with k of its tokens replaced by other candidates of
their positions (median of 5 draws), the rank of the true token among its position's candidates
with the rest of the sentence true (0: the objective's minimum), and whether one descent of the
search's walker (`veil.attacks.span.walker.Walker`, to its first local minimum) from the sentence
with k tokens wrong returns to it (of 4 draws): the size of its basin.

    python benchmarks/span_landscape.py [--peel 8] [--sentences 3] [--wrong 1,2,4,8] [--basin 4,8,12]
    python benchmarks/span_landscape.py --peel '' --locality     # what `veil.attacks.span.suffix` reads

`--locality`: how far a position's cost reaches (every sentence, every position t, every offset
d in -5..5: the mean change of position t's cost when the token at t + d is replaced by another
candidate, 3 draws each), and how well the right-to-left seeds' rule picks a token (given the
sentence's true tokens from t + 1 on and the position prior's best tokens left of t, the rank of
the true token at t among its candidates by the cost at t + 1, by the summed cost from t + 1 on,
and by the cost at t itself).
"""

from __future__ import annotations

import argparse
import random
import statistics

import numpy as np
import torch

from veil.attacks import create_attack, observe
from veil.attacks.harness import knowledge_for, private_batches
from veil.attacks.span import attack as span_attack
from veil.attacks.span.checks import CLSCheck
from veil.attacks.span.peel import setup_stage
from veil.attacks.span.walker import Walker
from veil.build import build_run
from veil.config import load_config


class _Captured(Exception):
    pass


def peel_inputs(batch_size: int, seed: int) -> tuple[dict, list[list[int]]]:
    """What `peel_search` is handed for this batch (residual, candidates, specials, options), and the batch's sentences."""
    over = ["model=minilm", "model.dropout=0", "model.pooling=cls", "data=sst2", "data.tokenizer=wordpiece"]
    model, data, defenses = build_run(load_config(None, [*over, "data.max_len=32", "data.train_size=64"]))
    batch = private_batches(data.test, batch_size, 1, seed=seed)[0]
    model.eval()
    box: dict = {}

    def capture(obs, res, cands_of, specials, **kw):  # type: ignore[no-untyped-def]
        box.update(res=res, cands_of=cands_of, specials=specials, kw=kw)
        raise _Captured

    real, span_attack.peel_search = span_attack.peel_search, capture
    try:
        know = knowledge_for(batch, data, defenses, 0, None)
        create_attack("span").reconstruct(observe(model, batch, defenses), know)
    except _Captured:
        pass
    finally:
        span_attack.peel_search = real
    model.eval()
    return box, [ids[m.bool()].tolist() for ids, m in zip(batch["input_ids"], batch["attention_mask"])]


def wrong(s: list[int], cands: list, k: int, rng: random.Random) -> list[int]:
    x = list(s)
    for t in rng.sample(range(1, len(s) - 1), min(k, len(s) - 2)):
        x[t] = int(cands[t][rng.randrange(len(cands[t]))])
    return x


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--peel", default="8", help="lengths of the sentences subtracted first")
    ap.add_argument("--sentences", type=int, default=3)
    ap.add_argument("--wrong", default="1,2,4,8")
    ap.add_argument("--basin", default="4,8,12")
    ap.add_argument("--locality", action="store_true", help="offset reach and the leftward growth's ranks, then stop")
    args = ap.parse_args()
    torch.set_num_threads(1)
    box, truth = peel_inputs(args.batch, args.seed)
    res, specials, kw = box["res"], box["specials"], box["kw"]
    left = sorted(truth, key=len)
    with torch.no_grad():
        for n in [int(v) for v in args.peel.split(",") if v]:
            s = next(s for s in left if len(s) == n)
            res.peel(s, CLSCheck(res))
            left.remove(s)
        stage = setup_stage(
            res,
            CLSCheck(res),
            box["cands_of"],
            specials,
            np.random.default_rng(0),
            {},
            rank_tol=kw["rank_tol"],
            prior_weight=kw["prior_weight"],
            narrow=kw["narrow"],
            min_len=3,
        )
        score, cands, rng = stage.score, stage.cands, random.Random(0)
        print(
            f"batch {args.batch}, {sum(map(len, left))} tokens left after peeling {args.peel or 'none'}: objective {stage.objective}, layer-2 rank {stage.rank2}"
        )
        if args.locality:
            locality(stage, left, specials, rng)
            return
        for s in left[: args.sentences]:
            n = len(s)
            true = float(score(torch.tensor([s]))[0].mean())
            costs = {
                k: statistics.median(float(score(torch.tensor([wrong(s, cands, k, rng)]))[0].mean()) for _ in range(5))
                for k in map(int, args.wrong.split(","))
            }
            ranks = []
            for t in range(1, n - 1):
                var = torch.tensor([s]).repeat(len(cands[t]), 1)
                var[:, t] = cands[t]
                f = score(var)[0].sum(1)
                ranks.append(int((f < f[cands[t] == s[t]].min()).sum()))
            walker = next(w for w in stage.walks.walkers if w.n == n)
            basin = {}
            for k in map(int, args.basin.split(",")):
                back = 0
                for trial in range(4):
                    w = Walker(walker.sets, np.random.default_rng(trial))
                    w.x = torch.tensor([wrong(s, walker.sets, k, rng)])
                    while w.step(score) and w.cur is not None:
                        pass
                    back += w.best[2][0].tolist() == s
                basin[k] = f"{back}/4"
            print(
                f"{n} tokens: cost per position {true:.4f}; with k wrong "
                + ", ".join(f"{k}: {c:.4f}" for k, c in costs.items())
                + f"; true token's rank at its position: max {max(ranks)} over {len(ranks)} positions"
                + "; one descent back from k wrong: "
                + ", ".join(f"{k}: {v}" for k, v in basin.items())
            )


def locality(stage: object, sents: list[list[int]], specials: object, rng: random.Random) -> None:
    """`--locality` (module docstring)."""
    score, cands, prior = stage.score, stage.cands, stage.prior  # type: ignore[attr-defined]
    change: dict[int, list[float]] = {d: [] for d in range(-5, 6)}
    for s in sents:
        n, rows, meta = len(s), [], []
        base = score(torch.tensor([s]))[0][0]
        for t in range(1, n - 1):
            for d in change:
                if 1 <= t + d < n - 1:
                    for _ in range(3):
                        x = list(s)
                        x[t + d] = int(cands[t + d][rng.randrange(len(cands[t + d]))])
                        rows.append(x)
                        meta.append((t, d))
        f = torch.cat([score(torch.tensor(rows[i : i + 512]))[0] for i in range(0, len(rows), 512)])
        for (t, d), row in zip(meta, f):
            change[d].append(float((row[t] - base[t]).abs()))
    print(
        "mean change of position t's cost when the token at t + d changes: "
        + ", ".join(f"d={d}: {statistics.mean(v):.3f}" for d, v in change.items())
    )
    special = {specials.cls, specials.sep}  # type: ignore[attr-defined]
    content = [torch.tensor([v for v in c.tolist() if v not in special]) for c in cands]
    filler = [0] + [prior.best(t, content[t]) or int(content[t][0]) for t in range(1, len(content))]
    ranks: dict[str, list[int]] = {"cost at t + 1": [], "summed cost from t + 1": [], "cost at t": []}
    for s in sents:
        for t in range(len(s) - 2, 0, -1):
            x = [s[0], *filler[1:t], *s[t:]]
            var = torch.tensor([x]).repeat(len(content[t]), 1)
            var[:, t] = content[t]
            pc = score(var)[0]
            i = int(torch.nonzero(content[t] == s[t])[0])
            for name, c in zip(ranks, (pc[:, t + 1], pc[:, t + 1 :].sum(1), pc[:, t])):
                ranks[name].append(int((c < c[i]).sum()))
    for name, r in ranks.items():
        a = np.array(r)
        print(
            f"growing leftwards, the true token ranked by the {name}: first at {(a == 0).mean():.1%}, top 3 at {(a < 3).mean():.1%} of {len(a)} positions"
        )


if __name__ == "__main__":
    main()
