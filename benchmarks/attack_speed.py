"""Attack speed on this machine: APRIL seconds per image (median), DLG / IG iterations per second.

python benchmarks/attack_speed.py [--repeats 20] [--iterations 50] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from veil.attacks import Knowledge, create_attack, observe
from veil.data import load_data
from veil.models import create_model

APRIL_MODELS = [
    ("vit-digits", {}, ("digits", {})),
    ("vit-tiny", {"in_chans": 1, "image_size": 32, "num_classes": 2}, ("lfw", {"size": 32, "channels": 1})),
    ("hf-vit", {"in_chans": 1, "image_size": 32, "num_classes": 2}, ("lfw", {"size": 32, "channels": 1})),
]


def april_seconds(model_name: str, overrides: dict, data: tuple[str, dict], repeats: int) -> float:
    """Median wall time of the attack alone (the client step is not timed)."""
    torch.manual_seed(0)
    model = create_model(model_name, **overrides)
    split = load_data(data[0], **data[1]).test
    attack = create_attack("april")
    times = []
    for i in range(repeats):
        obs = observe(model, {k: v[i : i + 1] for k, v in split.items()})
        times.append(attack.reconstruct(obs, Knowledge(batch_size=1)).stats["seconds"])
    return statistics.median(times[1:] if repeats > 1 else times)  # the first call pays one-off setup


def iterations_per_second(name: str, iterations: int, **settings) -> float:
    torch.manual_seed(0)
    model = create_model("vit-digits")
    batch = {k: v[:1] for k, v in load_data("digits").test.items()}
    rec = create_attack(name, iterations=iterations, restarts=1, **settings).reconstruct(
        observe(model, batch), Knowledge(batch_size=1)
    )
    return float(rec.stats["iterations_per_second"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--iterations", type=int, default=50)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = [(f"april s/image ({m})", april_seconds(m, o, d, args.repeats)) for m, o, d in APRIL_MODELS]
    rows.append(("ig it/s (vit-digits)", iterations_per_second("ig", args.iterations)))
    rows.append(("dlg it/s (vit-digits, lbfgs evals)", iterations_per_second("dlg", args.iterations)))
    rows.append(
        ("dlg it/s (vit-digits, adam)", iterations_per_second("dlg", args.iterations, optimizer="adam", lr=0.01))
    )
    width = max(len(r[0]) for r in rows)
    print(f"{'measure':<{width}}  value   (threads={args.threads})")
    for label, value in rows:
        print(f"{label:<{width}}  {value:.4f}")


if __name__ == "__main__":
    main()
