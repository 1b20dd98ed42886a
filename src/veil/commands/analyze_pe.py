"""`veil analyze pe RUN_DIR [--out DIR] [--dims 10]`: PCA of the trained position embeddings.

Writes pe_analysis.json and pe_analysis.md (explained variance by projected dimension, the MJP
paper's Table XII) and pe_pca_1d/2d/3d.png (its Fig. 2 / Fig. 7) into DIR (default
RUN_DIR/analysis/pe).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from veil.commands import subcommand
from veil.errors import VeilError


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `pe` under the `veil analyze` subcommands."""
    p = subcommand(
        sub, "pe", "PCA of the position-embedding table: explained variance and 1-D/2-D/3-D plots", __doc__, run
    )
    p.add_argument("run_dir", help="a run folder written by `veil train`")
    p.add_argument("--out", default=None, help="output folder (default RUN_DIR/analysis/pe)")
    p.add_argument("--dims", type=int, default=10, help="projected dimensions to report (default 10)")
    p.add_argument("--rows", type=int, default=None, help="text: only the first ROWS positions")
    p.add_argument(
        "--checkpoint",
        default=None,
        metavar="last|STEP|init",
        help="which weights to read when the run has no finished model (default: the finished model)",
    )


def run(args: argparse.Namespace) -> int:
    # torch and the packages load when the command runs, not when `veil --help` builds the parser
    from veil.analysis.pe import analyze_model_pe
    from veil.build import load_run

    if args.dims < 1:
        raise VeilError(f"--dims must be >= 1, got {args.dims}")
    cfg, model, _, _ = load_run(args.run_dir, checkpoint=args.checkpoint)
    title = f"{cfg.model['name']} + {'+'.join(d['name'] for d in cfg.defense) or 'none'}"
    out = Path(args.out) if args.out else Path(args.run_dir) / "analysis" / "pe"
    result = analyze_model_pe(model, out, title, args.dims, args.rows)
    print(json.dumps(result, indent=2))
    return 0
