"""Evaluations of a trained run beyond its test accuracy, run by the audit after training when a
task asks for them (`evaluate:` in a scenario task) and cached in the run folder:

  test_shuffle: [G, ...]  test accuracy under a test-time jigsaw shuffle at each ratio G (the MJP
                          paper's consistency evaluation, Fig. 4/5): an MJP run puts its learned
                          E_unk at the shuffled slots, a run without MJP is shuffled with its PEs
                          kept (`evaluate_shuffled`, also behind `veil eval --shuffle-gamma`)
  pe: DIMS                cumulative explained variance (%) of the position embeddings by PCA
                          dimension 1..DIMS (MJP Table XII; `veil.analysis.pe`)
  membership: true        the loss-threshold membership attack on the released model (Yeom et al.
                          2018, `veil.attacks.membership`): the run's training split (members)
                          against its test split (non-members); TPR at 0.1 % / 1 % FPR and AUC.
                          A test split from another source than the training one (SST-2's GLUE
                          dev) inflates it: `protocol: dp-audit` holds non-members out of the
                          training split itself
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from veil.analysis.pe import explained_variance, pca, pe_rows
from veil.attacks.membership import confidence_logits, loss_scores
from veil.build import load_run, open_run
from veil.defenses.base import check_unit_interval
from veil.defenses.mjp import MJP
from veil.errors import VeilError
from veil.io import intact, write_checked_text
from veil.metrics.membership import summarize
from veil.runtime import use_threads
from veil.training.loop import evaluate, pick_device


def run_evaluations(run_dir: Path, wanted: dict[str, Any], seed: int) -> dict[str, dict[str, float]]:
    """The task's evaluations of one finished run, cached in RUN_DIR/evaluations.json (hashed)."""
    path = Path(run_dir) / "evaluations.json"
    if intact(path) and path.is_file():
        cached = json.loads(path.read_text())
        if cached.get("wanted") == wanted:
            return cached["results"]
    out: dict[str, dict[str, float]] = {}
    if wanted.get("test_shuffle"):
        out["test_shuffle"] = {
            f"{g:g}": evaluate_shuffled(run_dir, float(g), seed=seed)["test_accuracy"] for g in wanted["test_shuffle"]
        }
    if wanted.get("pe"):
        _, model, _, _ = load_run(run_dir)
        _, ratios = pca(pe_rows(model)[0])
        out["pe"] = {str(k): float(v) for k, v in explained_variance(ratios, int(wanted["pe"])).items()}
    if wanted.get("membership"):
        _, model, data, _ = load_run(run_dir)
        out["membership"] = membership_loss(model, data)
    write_checked_text(path, json.dumps({"wanted": wanted, "results": out}))
    return out


def membership_loss(model: Any, data: Any) -> dict[str, float]:
    """The loss attack's TPR at 0.1 % / 1 % FPR and AUC, training split against test split."""
    phi_in, phi_out = (loss_scores(confidence_logits(model, split)).numpy() for split in (data.train, data.test))
    return {k: float(v) for k, v in summarize(phi_in, phi_out).items() if k != "curve"}


def evaluate_shuffled(
    run_dir: str | Path,
    gamma: float,
    selection: str | None = None,
    window: int | None = None,
    keep_pe: bool = False,
    seed: int = 0,
    checkpoint: str | None = None,
) -> dict[str, Any]:
    """Load the run (its finished model, or the weights `checkpoint` names) and measure clean and
    shuffled test accuracy."""
    gamma = check_unit_interval("--shuffle-gamma", gamma)
    MJP(window=window if window is not None else 32, selection=selection or "block")  # one-line errors first
    cfg, model, data, defenses, weights = open_run(run_dir, checkpoint=checkpoint)
    use_threads(cfg.train.threads)  # as `veil train`: 0 is what the machine can give now
    mjp = next((d for d in defenses if isinstance(d, MJP)), None)
    if mjp is None:  # an undefended (or otherwise defended) run: plain shuffle, PEs kept
        if model.embedding_transform is not None:
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
        "weights": weights.record(),
    }
