"""`veil eval RUN_DIR [--shuffle-gamma G] [--out OUT]`: test accuracy of a trained run, optionally
under a test-time jigsaw shuffle (the MJP paper's consistency evaluation, Fig. 4/5, Table VIII (b)).

At ratio G each test sequence gets the token-wise jigsaw shuffle of Alg. 1. A run trained with
MJP (variant ``mjp``) puts its learned ``E_unk`` at the shuffled slots, as the authors'
consistency code does (the client knows what it shuffled); ``--keep-pe`` keeps the original PEs
instead (the "w/o E_unk" ablation). A run without MJP is shuffled with its PEs kept, with the
same selection (block-wise for images, n-gram windows of 32 for text unless told otherwise).
Writes OUT/summary.json with ``test_accuracy`` (shuffled) and ``clean_test_accuracy`` (G = 0).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from veil.errors import VeilError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "eval",
        help="evaluate a trained run, optionally with test-time jigsaw shuffling",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run_dir", help="a run folder written by `veil train`")
    p.add_argument(
        "--shuffle-gamma", type=float, default=0.0, help="test-time shuffle ratio in [0, 1] (default 0: clean)"
    )
    p.add_argument(
        "--selection",
        choices=("block", "random"),
        default=None,
        help="image selection (default: the run's, else block)",
    )
    p.add_argument("--window", type=int, default=None, help="text n-gram window (default: the run's, else 32)")
    p.add_argument("--keep-pe", action="store_true", help="keep the original PEs at shuffled slots (no E_unk)")
    p.add_argument("--seed", type=int, default=0, help="seed of the test-time shuffles")
    p.add_argument("--out", default=None, help="output folder (default RUN_DIR/eval/shuffle-G)")
    p.set_defaults(run=run)


def evaluate_shuffled(
    run_dir: str | Path,
    gamma: float,
    selection: str | None = None,
    window: int | None = None,
    keep_pe: bool = False,
    seed: int = 0,
) -> dict[str, Any]:
    """Load the run and measure clean and shuffled test accuracy."""
    # torch and the packages load when the command runs, not when `veil --help` builds the parser
    import torch

    from veil.build import load_run
    from veil.defenses.base import check_unit_interval
    from veil.defenses.mjp import MJP
    from veil.runtime import use_threads
    from veil.training.loop import evaluate, pick_device

    gamma = check_unit_interval("--shuffle-gamma", gamma)
    MJP(window=window if window is not None else 32, selection=selection or "block")  # one-line errors first
    cfg, model, data, defenses = load_run(run_dir)
    use_threads(cfg.train.threads)  # as `veil train`: 0 is what the machine can give now
    mjp = next((d for d in defenses if isinstance(d, MJP)), None)
    if mjp is None:  # an undefended (or otherwise defended) run: plain shuffle, PEs kept
        if model._embedding_transform is not None:
            raise VeilError(
                f"run '{run_dir}' uses another embedding transform; test-time shuffling needs no other or MJP"
            )
        mjp = MJP(
            gamma=0.0,
            aux="none",
            variant="shuffle",
            selection=selection or "block",
            window=window if window is not None else 32,
        ).attach(model)
    else:
        mjp.selection = selection or mjp.selection
        mjp.window = window if window is not None else mjp.window
    device = pick_device(cfg.train.device)
    model.to(device)
    bs = cfg.train.eval_batch_size
    clean = evaluate(model, data.test, bs, device)["test_accuracy"]
    mjp.set_eval_gamma(gamma, unk=not keep_pe)
    torch.manual_seed(seed)
    mjp._gen = None
    mjp.seed = seed
    shuffled = evaluate(model, data.test, bs, device)["test_accuracy"]
    mjp.set_eval_gamma(None)
    return {
        "run": str(run_dir),
        "model": cfg.model["name"],
        "data": cfg.data["name"],
        "defense": [d["name"] for d in cfg.defense] or ["none"],
        "shuffle_gamma": gamma,
        "selection": mjp.selection if model.modality == "image" else None,
        "window": mjp.window if model.modality == "text" else None,
        "unk_at_shuffled": mjp.variant == "mjp" and not keep_pe,
        "seed": seed,
        "test_accuracy": shuffled,
        "clean_test_accuracy": clean,
    }


def run(args: argparse.Namespace) -> int:
    summary = evaluate_shuffled(args.run_dir, args.shuffle_gamma, args.selection, args.window, args.keep_pe, args.seed)
    out = Path(args.out) if args.out else Path(args.run_dir) / "eval" / f"shuffle-{args.shuffle_gamma:g}"
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    return 0
