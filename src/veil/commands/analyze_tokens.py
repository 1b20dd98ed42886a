"""`veil analyze tokens RUN_DIR [RUN_DIR ...] [--out DIR]`: the MJP paper's Fig. 9.

For each trained text run, a text attack (TAG by default) rebuilds `--samples` test sentences
from one defended client update each (batch 1, labels known); the original and recovered
tokens' embeddings are projected to 2-D by PCA and compared by cosine similarity
(`veil.analysis.tokens`). Writes DIR/tokens.json (per run: cosines, token recovery, the points)
and DIR/token_pca.png (one panel per run), and DIR/summary.json (hashed, as the audit writes
its own, naming the figure), so DIR can be collected as an audit folder is. DIR defaults to the
first run's analysis/tokens.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from veil.errors import VeilError


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `tokens` under the `veil analyze` subcommands."""
    p = sub.add_parser(
        "tokens",
        help="2-D PCA of recovered vs original token embeddings with their cosine (MJP Fig. 9)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run_dirs", nargs="+", help="run folders written by `veil train` (text models)")
    p.add_argument("--out", default=None, help="output folder (default FIRST_RUN/analysis/tokens)")
    p.add_argument("--attack", default="tag", help="the text attack (default tag)")
    p.add_argument("--iterations", type=int, default=300, help="the attack's iterations (default 300)")
    p.add_argument("--samples", type=int, default=8, help="test sentences attacked per run (default 8)")
    p.add_argument("--seed", type=int, default=0, help="which test sentences, and the attack's seed")
    p.add_argument("--labels", default=None, help="comma-separated panel labels (default: each run's defense)")
    p.add_argument("--jobs", type=int, default=1, help="worker processes, one run each (default 1); same numbers")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    # torch and the packages load when the command runs, not when `veil --help` builds the parser
    from veil.io import write_checked_text
    from veil.report.token_pca import token_pca_figure

    if args.samples < 1 or args.iterations < 1:
        raise VeilError(f"--samples and --iterations must be >= 1, got {args.samples} and {args.iterations}")
    labels = args.labels.split(",") if args.labels else None
    if labels is not None and len(labels) != len(args.run_dirs):
        raise VeilError(f"--labels names {len(labels)} panels for {len(args.run_dirs)} runs")
    out = Path(args.out) if args.out else Path(args.run_dirs[0]) / "analysis" / "tokens"
    if args.jobs < 1:
        raise VeilError(f"--jobs must be >= 1, got {args.jobs}")
    work = [
        (run_dir, labels[i] if labels else None, args.attack, args.iterations, args.samples, args.seed)
        for i, run_dir in enumerate(args.run_dirs)
    ]
    if args.jobs > 1 and len(work) > 1:  # one process per run, one torch thread each; the same numbers
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(min(args.jobs, len(work)), mp_context=ctx) as pool:
            panels = list(pool.map(_panel, work))
    else:
        panels = [_panel(w) for w in work]
    token_pca_figure(panels, out / "token_pca.png", f"{args.attack} on {panels[0]['model']}: recovered vs original")
    (out / "tokens.json").write_text(json.dumps({"panels": panels}, indent=1))
    summary = {
        "scenario": "mjp-fig9-tokens",
        "command": "veil analyze tokens " + " ".join(f"'{r}'" for r in args.run_dirs),
        "settings": {"attack": args.attack, "iterations": args.iterations, "samples": args.samples, "seed": args.seed},
        "tasks": {"fig9": {"figure": "token_pca.png"}},
        "panels": panels,
    }
    write_checked_text(out / "summary.json", json.dumps(summary, indent=1))
    for p in panels:
        print(
            f"{p['label']}: cosine_2d {p['cosine_2d']:.3f} (pooled {p['cosine_2d_pooled']:.3f}), "
            f"cosine_full {p['cosine_full']:.3f}, token_recovery {p['token_recovery']:.3f}, {p['tokens']} tokens"
        )
    print(f"wrote {out / 'token_pca.png'} and {out / 'tokens.json'}")
    return 0


def _panel(work: tuple) -> dict:
    """One run's panel: attack its test sentences and measure (`veil.analysis.tokens`)."""
    from veil.analysis.tokens import recovered_embeddings
    from veil.build import load_run
    from veil.runtime import use_threads

    run_dir, label, attack, iterations, samples, seed = work
    cfg, model, data, defenses = load_run(run_dir)
    if model.modality != "text":
        raise VeilError(f"run '{run_dir}' is an {model.modality} model; Fig. 9 compares token embeddings")
    use_threads(cfg.train.threads)
    label = label or ("+".join(_label(d) for d in cfg.defense) or "none")
    result = recovered_embeddings(
        model, data, defenses, attack, {"iterations": iterations}, samples=samples, seed=seed, grant={"labels": True}
    )
    return {"label": label, "run": str(run_dir), "model": cfg.model["name"], **result}


def _label(d: dict) -> str:
    extra = ",".join(f"{k}={v}" for k, v in sorted(d.items()) if k != "name")
    return f"{d['name']}({extra})" if extra else d["name"]
