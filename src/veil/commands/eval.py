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

from veil.commands import subcommand


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = subcommand(sub, "eval", "evaluate a trained run, optionally with test-time jigsaw shuffling", __doc__, run)
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
    p.add_argument(
        "--checkpoint",
        default=None,
        metavar="last|STEP|init",
        help="which weights to evaluate when the run has no finished model (default: the finished model)",
    )
    p.add_argument("--out", default=None, help="output folder (default RUN_DIR/eval/shuffle-G)")


def run(args: argparse.Namespace) -> int:
    # torch and the engine load when the command runs, not when `veil --help` builds the parser
    from veil.experiments.evaluations import evaluate_shuffled

    summary = evaluate_shuffled(
        args.run_dir, args.shuffle_gamma, args.selection, args.window, args.keep_pe, args.seed, args.checkpoint
    )
    out = Path(args.out) if args.out else Path(args.run_dir) / "eval" / f"shuffle-{args.shuffle_gamma:g}"
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    return 0
