"""Screen DP-SGD recipes for MiniLM on SST-2 on a VALIDATION split of the training pool (never the test split).

The recipe of `configs/dp_minilm_sst2.yaml` was chosen here. Compute is scarce (a contended CPU),
so the screen trains only what a parameter-efficient recipe trains, on cached inputs: the pretrained
MiniLM-L6 (dropout 0, eval mode) runs once over the training pool up to the input of its last layer
(`runs/dp/features_l5.pt`); each variant then trains with Opacus' own PrivacyEngine (Poisson sampling,
ghost clipping, RDP accountant, sigma from `make_private_with_epsilon`) either

- ``head``: the classifier on the mean-pooled output of the frozen encoder (770 parameters), or
- ``top1``: the last encoder layer + the classifier (1.8 M parameters),

with AdamW and veil's warm-up + cosine schedule, exactly the computation veil's DP-SGD runs with
``trainable`` set to the same parameters and model dropout 0. Validation: 1,000 sentences of the
shipped training pool (permutation seeded 10_000, as scripts/screen_aegis_minilm.py), training on the
other 7,000, delta = 1/7,000, epsilon 8. The variant list is fixed in this file before any run
(the ``E5`` head rows were added after the first rows, see below; the ``top1`` rows were stopped
unfinished: a contended CPU gave the first one under 5 CPU-minutes in 17 minutes).

After the choice, ``--test`` trains the chosen variant on all 8,000 sentences (delta 1/8,000) and
scores it on the test split, for several epsilons and seeds: the same computation as
``veil train configs/dp_minilm_sst2.yaml`` (which re-runs the frozen encoder every epoch: ~12
minutes an epoch on this machine's contended core), in seconds, so the privacy-utility curve gets
3 seeds; docs/results.md sets both side by side.

    python scripts/screen_dp_minilm.py --out runs/dp/screen [--variants "head lr3e-2 B512 E5,..."]
    python scripts/screen_dp_minilm.py --out runs/dp/curve --test --variants "head lr3e-2 B512 E5" --epsilon 1 3 8 0 --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

FEATURES = Path("runs/dp/features_l5.pt")
#: name -> (part, lr, logical batch, epochs)
VARIANTS: dict[str, tuple[str, float, int, int]] = {
    "head lr3e-3 B512 E10": ("head", 3e-3, 512, 10),
    "head lr1e-2 B512 E10": ("head", 1e-2, 512, 10),
    "head lr3e-2 B512 E10": ("head", 3e-2, 512, 10),
    "head lr1e-2 B1024 E20": ("head", 1e-2, 1024, 20),
    "top1 lr5e-4 B512 E5": ("top1", 5e-4, 512, 5),
    "top1 lr1e-3 B512 E5": ("top1", 1e-3, 512, 5),
    "top1 lr2e-3 B512 E5": ("top1", 2e-3, 512, 5),
    # added after the first head rows: a veil epoch costs a full MiniLM forward (~4 min on this
    # contended CPU), so the final runs need a short schedule: how much do 5 epochs lose?
    "head lr1e-2 B512 E5": ("head", 1e-2, 512, 5),
    "head lr3e-2 B512 E5": ("head", 3e-2, 512, 5),
    "head lr3e-2 B256 E5": ("head", 3e-2, 256, 5),
    "head lr1e-1 B1024 E5": ("head", 1e-1, 1024, 5),
}


def build_minilm() -> nn.Module:
    from veil.build import build_run
    from veil.config import from_dict

    cfg = from_dict(
        {
            "model": {"name": "minilm", "dropout": 0.0, "pooling": "mean"},
            "data": {"name": "sst2", "tokenizer": "wordpiece", "max_len": 32, "train_size": 8000},
        }
    )
    model, data, _ = build_run(cfg)
    return model.eval(), data


def cache_features() -> dict[str, Tensor]:
    """Hidden states entering MiniLM's last layer for the shipped training pool and test split."""
    if FEATURES.is_file():
        return torch.load(FEATURES)
    model, data = build_minilm()
    out: dict[str, Tensor] = {}
    cap: dict[str, Tensor] = {}
    hook = model.hf.bert.encoder.layer[5].register_forward_pre_hook(lambda m, a: cap.__setitem__("h", a[0]))
    with torch.no_grad():
        for split in ("train", "test"):
            d, hs = getattr(data, split), []
            for i in range(0, len(d["labels"]), 128):
                model({k: v[i : i + 128] for k, v in d.items()})
                hs.append(cap["h"].half())
            out.update(
                {f"{split}_h5": torch.cat(hs), f"{split}_labels": d["labels"], f"{split}_mask": d["attention_mask"]}
            )
    hook.remove()
    FEATURES.parent.mkdir(parents=True, exist_ok=True)
    torch.save(out, FEATURES)
    return out


class Top(nn.Module):
    """MiniLM's last layer + mean pooling + classifier, as veil's HFBert runs them."""

    def __init__(self, layer: nn.Module, classifier: nn.Module) -> None:
        super().__init__()
        self.layer, self.classifier = layer, classifier

    def forward(self, h: Tensor, mask: Tensor) -> Tensor:
        from veil.models.base import padding_bias

        seq = self.layer(h, attention_mask=padding_bias(mask, causal=False, dtype=h.dtype))
        seq = seq[0] if isinstance(seq, tuple) else seq
        m = mask.unsqueeze(-1).to(seq.dtype)
        return self.classifier((seq * m).sum(1) / m.sum(1).clamp_min(1.0))


class Head(nn.Module):
    def __init__(self, classifier: nn.Module) -> None:
        super().__init__()
        self.classifier = classifier

    def forward(self, pooled: Tensor, mask: Tensor) -> Tensor:
        return self.classifier(pooled)


def run_variant(
    name: str,
    train: tuple[Tensor, Tensor, Tensor],
    evals: tuple[Tensor, Tensor, Tensor],
    base: nn.Module,
    seed: int,
    eps: float | None,
) -> dict[str, Any]:
    """Train variant `name` on `train` (x, mask, y) with DP at `eps` (None: clipping, no noise), score on `evals`."""
    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader, TensorDataset

    from veil.training.loop import warmup_cosine

    part, lr, batch, epochs = VARIANTS[name]
    torch.manual_seed(seed)
    layer5, clf = copy.deepcopy(base.hf.bert.encoder.layer[5]), copy.deepcopy(base.hf.classifier)
    module = Head(clf) if part == "head" else Top(layer5, clf)
    module.train()
    opt = torch.optim.AdamW(module.parameters(), lr=lr, weight_decay=0.01)
    loader = DataLoader(TensorDataset(*train), batch_size=batch)
    pe = PrivacyEngine(accountant="rdp")
    delta = 1.0 / len(train[2])
    common = dict(
        module=module,
        optimizer=opt,
        criterion=nn.CrossEntropyLoss(),
        data_loader=loader,
        max_grad_norm=1.0,
        grad_sample_mode="ghost",
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if eps is None:
            module, opt, crit, loader = pe.make_private(noise_multiplier=0.0, **common)
        else:
            module, opt, crit, loader = pe.make_private_with_epsilon(
                target_epsilon=eps, target_delta=delta, epochs=epochs, **common
            )
        sched = torch.optim.lr_scheduler.LambdaLR(opt.original_optimizer, warmup_cosine(epochs * len(loader), 0.1))
        t0 = time.perf_counter()
        for _ in range(epochs):
            for xb, mb, yb in loader:
                opt.zero_grad()
                if len(yb):
                    crit(module(xb, mb), yb).backward()
                opt.step()
                sched.step()
        spent = pe.get_epsilon(delta) if eps is not None else float("inf")
    module.eval()
    with torch.no_grad():
        acc = float((module(evals[0], evals[1]).argmax(-1) == evals[2]).float().mean())
    return {
        "variant": name,
        "seed": seed,
        "accuracy": acc,
        "epsilon": spent,
        "delta": delta,
        "noise_multiplier": opt.noise_multiplier,
        "seconds": round(time.perf_counter() - t0, 1),
    }


def pooled(base: nn.Module, h5: Tensor, mask: Tensor) -> Tensor:
    """The frozen encoder's mean-pooled output from the cached last-layer inputs."""
    with torch.no_grad():
        return torch.cat(
            [
                Top(base.hf.bert.encoder.layer[5], nn.Identity())(h5[i : i + 500], mask[i : i + 500])
                for i in range(0, len(h5), 500)
            ]
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="runs/dp/screen")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument(
        "--epsilon", type=float, nargs="+", default=[8.0], help="target epsilons; 0 = clipping without noise"
    )
    p.add_argument(
        "--test", action="store_true", help="AFTER the choice: train on all 8,000 sentences, score on the test split"
    )
    args = p.parse_args()
    torch.set_num_threads(1)
    raw = cache_features()
    base, _ = build_minilm()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = json.loads((out / "screen.json").read_text()) if (out / "screen.json").is_file() else []
    done = {(r["variant"], r["seed"], r.get("target_epsilon")) for r in rows}
    h5, mask, y = raw["train_h5"].float(), raw["train_mask"], raw["train_labels"]
    feats: dict[str, Tensor] = {}
    for name in args.variants.split(","):
        part = VARIANTS[name][0]
        if part == "head" and "train" not in feats:
            feats["train"] = pooled(base, h5, mask)
            if args.test:
                feats["test"] = pooled(base, raw["test_h5"].float(), raw["test_mask"])
        x = feats["train"] if part == "head" else h5
        for eps, seed in [(e or None, sd) for e in args.epsilon for sd in args.seeds]:
            if (name, seed, eps) in done:
                continue
            if args.test:
                xt = feats["test"] if part == "head" else raw["test_h5"].float()
                train, evals = (x, mask, y), (xt, raw["test_mask"], raw["test_labels"])
            else:
                perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(10_000 + seed))
                val, tr = perm[:1000], perm[1000:]
                train, evals = (x[tr], mask[tr], y[tr]), (x[val], mask[val], y[val])
            row = {
                **run_variant(name, train, evals, base, seed, eps),
                "target_epsilon": eps,
                "split": "test" if args.test else "validation",
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
            (out / "screen.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
