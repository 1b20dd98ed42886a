"""Why mean pooling stops the span attack's peeling where [CLS] pooling does not (docs/span.md).

The exact sentence test (`veil.attacks.span.checks.CLSCheck`) reads the row space of the last
block's Q-projection gradient. With [CLS] pooling only the B [CLS] rows reach the loss (rank B);
with mean pooling every real token's row does (rank B*T, up to the width), and the test is usable
only while that leaves a gap (`SpanOptions.cls_fill`). Per batch size and pooling, on the shipped
config's model (one client step per draw, no search): the rank, whether the test is usable, and,
with the test forced on (`cls_fill` 1), the largest distance of the batch's true sentences against
the smallest and the median distance of each sentence with one token replaced (3 per sentence);
and the same for the embedding-row test (`veil.attacks.span.checks.RowCheck`), which needs no gap.

    python benchmarks/span_pooling.py [--batches 4,8,12,16] [--draws 2] [--config configs/minilm_sst2.yaml]
"""

from __future__ import annotations

import argparse
import json

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/minilm_sst2.yaml")
    ap.add_argument("--batches", default="4,8,12,16")
    ap.add_argument("--draws", type=int, default=2)
    ap.add_argument("--pooling", default="mean,cls")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from veil.attacks.base import observe
    from veil.attacks.harness import private_batches
    from veil.attacks.span.checks import CLSCheck, RowCheck
    from veil.attacks.span.residual import Residual
    from veil.attacks.span.score import _probe
    from veil.commands.attack import load_target

    for pool in args.pooling.split(","):
        over = ["model.dropout=0", f"model.pooling={pool}", "data.train_size=64"]
        model, data, defenses, _, _ = load_target(args.config, over)
        g = torch.Generator().manual_seed(0)
        for B in (int(b) for b in args.batches.split(",")):
            for i, batch in enumerate(private_batches(data.test, B, args.draws, 0)):
                torch.manual_seed(i)
                obs = observe(model, batch, defenses)
                res = Residual(obs, B)
                check, forced, rows = CLSCheck(res), CLSCheck(res, max_fill=1.0), RowCheck(res)
                model.eval()
                ids, mask = batch["input_ids"], batch["attention_mask"]
                true, wrong, row_true, row_wrong = [], [], [], []
                for b in range(B):
                    n = int(mask[b].sum())
                    for k in range(4):
                        s = ids[b : b + 1, :n].clone()
                        if k:  # one token replaced by another sentence's
                            s[0, int(torch.randint(1, n - 1, (1,), generator=g))] = int(ids[(b + 1) % B, k])
                            if torch.equal(s, ids[b : b + 1, :n]):  # the same token: not a wrong sentence
                                continue
                        z = _probe(model, [forced.module], forced.module, s, torch.ones_like(s))[id(forced.module)]
                        (wrong if k else true).append(float(forced.distance(z)))
                        (row_wrong if k else row_true).append(float(rows.sentences(model, s)))
                model.train()
                wrong.sort()
                row_wrong.sort()
                row = {"pooling": pool, "batch": B, "draw": i, "tokens": int(mask.sum()), "rows": check.rows}
                row.update(rank=check.span.rank, width=check.span.width, usable=check.usable)
                row.update(true_max=max(true), wrong_min=wrong[0], wrong_median=wrong[len(wrong) // 2])
                row.update(row_true_max=max(row_true), row_wrong_min=row_wrong[0])
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
