"""The three leakage channels of AEGIS (`seeds/aegis-gradient-isolation.txt`), computed from one
client step, per layer:

  Channel 1  attention projections: dL/dW = sum_t delta_t x_t^T, so rank <= n tokens and the
             row space lies in span{x_t} (x_t = the projection's true inputs, captured by
             forward hooks: unlike an attack, the analysis may see the batch).
  Channel 2  token-embedding gradient rows: non-zero exactly at the present tokens.
  Channel 3  MLP expansion (and, beyond the paper, the MLP down-projection): as channel 1.

For a gradient G (out, in) and the true inputs X (n, in) of its module we report:
  rank       numerical rank (singular values > 1e-6 * the largest)
  overlap    mean ||P_k x|| / ||x|| over true inputs, P_k the top-k right singular subspace,
             k = min(rank, n); `chance` = sqrt(k / in) is what random directions give
  span_hit   share of true inputs with relative distance < `tol` to the rank-r span (r < in):
             the span check's success through this channel; `decoy_hit` the same for the inputs
             of another batch (a test that passes everything tells nothing). A full-rank
             gradient (noise) passes every vector: span_hit is then 0 by definition (no test).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from veil.attacks.adaptive import chi2_scores, guess_present, random_guess_f1
from veil.attacks.base import Observation
from veil.metrics import presence
from veil.models.base import Batch, VeilModel, linear_weight
from veil.training.step import client_step


@dataclass
class Capture:
    """Forward pre-hooks recording each module's input at the batch's real positions."""

    modules: dict[str, nn.Module]
    seen: dict[str, Tensor] = field(default_factory=dict)

    def run(self, model: VeilModel, batch: Batch) -> dict[str, Tensor]:
        mask = batch["attention_mask"].bool()
        hooks = [
            m.register_forward_pre_hook(lambda _m, a, k=k: self.seen.__setitem__(k, a[0].detach()[mask]))
            for k, m in self.modules.items()
        ]
        try:
            with torch.no_grad():
                model(batch)
        finally:
            for h in hooks:
                h.remove()
        return dict(self.seen)


def channel_modules(model: VeilModel) -> dict[str, tuple[str, int, list[nn.Module]]]:
    """key -> (channel, block, gradient modules); the input of the first module is the true input."""
    out: dict[str, tuple[str, int, list[nn.Module]]] = {}
    for b, att in enumerate(model.attention_layers()):
        out[f"attn_qkv.{b}"] = ("1: attention q/k/v", b, list({id(m): m for m in (att.q, att.k, att.v)}.values()))
        out[f"attn_o.{b}"] = ("1: attention o", b, [att.o])
    for b, (ups, down) in enumerate(zip(model.mlp_up_groups(), model.mlp_down())):
        out[f"mlp_up.{b}"] = ("3: MLP up", b, list(ups))
        out[f"mlp_down.{b}"] = ("3': MLP down", b, [down])
    return out


def span_stats(g: Tensor, x: Tensor, decoys: Tensor, tol: float) -> dict[str, Any]:
    """rank, overlap (vs chance), span_hit and decoy_hit of inputs x against the row space of g."""
    g, x, decoys = g.double(), x.double(), decoys.double()
    _, s, vh = torch.linalg.svd(g, full_matrices=False)
    width = g.shape[1]
    rank = int((s > 1e-6 * s[0]).sum()) if s.numel() and s[0] > 0 else 0
    k = min(rank, len(x))
    basis = vh[:k].T

    def rel(v: Tensor, B: Tensor) -> Tensor:
        return (v - (v @ B) @ B.T).norm(dim=1) / v.norm(dim=1).clamp_min(1e-30)

    overlap = float(((x @ basis).norm(dim=1) / x.norm(dim=1).clamp_min(1e-30)).mean()) if k else 0.0
    full = vh[:rank].T
    testable = 0 < rank < width
    hit = float((rel(x, full) < tol).double().mean()) if testable else 0.0
    decoy = float((rel(decoys, full) < tol).double().mean()) if testable and len(decoys) else 0.0
    return {
        "rank": rank,
        "width": width,
        "tokens": len(x),
        "overlap": overlap,
        "chance": (k / width) ** 0.5,
        "span_hit": hit,
        "decoy_hit": decoy,
        "full_rank": rank >= width,
    }


def embedding_stats(obs: Observation, batch: Batch, special: set[int]) -> dict[str, Any]:
    """Channel 2: non-zero rows vs present tokens, row-norm spread, and the presence tests' F1."""
    model = obs.model
    emb = model.token_embedding()
    if not obs.has_grad(emb):
        return {"exported": False}
    rows = obs.grad(emb).double()
    norms = rows.norm(dim=1)
    truth = set(batch["input_ids"][batch["attention_mask"].bool()].tolist()) - special
    nonzero = set(torch.nonzero(norms > 0).flatten().tolist()) - special
    z, _ = chi2_scores(rows.float())
    tested = set(guess_present(z, rows.shape[1], 1.0 / rows.shape[0]).tolist()) - special
    present = norms[sorted(truth)] if truth else norms[:0]
    V = rows.shape[0]
    return {
        "exported": True,
        "vocab": V,
        "present_tokens": len(truth),
        "nonzero_rows": int((norms > 0).sum()),
        "row_norm_max_over_median": float(present.max() / present.median())
        if len(present) and present.median() > 0
        else None,
        "nonzero_f1": presence(truth, nonzero)["presence_f1"],
        "chi2_test_f1": presence(truth, tested)["presence_f1"],
        "chi2_found": len(tested),
        "random_f1_same_guesses": random_guess_f1(len(truth), len(tested), V),
    }


def analyze_channels(
    model: VeilModel, batch: Batch, decoy: Batch, defenses: list, tol: float = 0.01, special: set[int] | None = None
) -> dict[str, Any]:
    """Run one defended client step on `batch` and measure every channel per layer."""
    was = model.training
    model.eval()
    mods = channel_modules(model)
    firsts = {k: v[2][0] for k, v in mods.items()}
    true_x = Capture(firsts).run(model, batch)
    decoy_x = Capture(firsts).run(model, decoy)
    res = client_step(model, batch, defenses, optimizer=None, step=0)
    model.train(was)
    obs = Observation(model, res.grads or {})
    layers = []
    for key, (channel, block, modules) in mods.items():
        row: dict[str, Any] = {"key": key, "channel": channel, "block": block}
        if not all(obs.has_grad(m) for m in modules):
            row.update(exported=False, rank=0, overlap=0.0, span_hit=0.0, decoy_hit=0.0)
        else:
            g = torch.cat([linear_weight(m, obs.grad(m)) for m in modules], dim=0)
            row.update(exported=True, **span_stats(g, true_x[key], decoy_x[key], tol))
        layers.append(row)
    return {
        "layers": layers,
        "embedding": embedding_stats(obs, batch, special or set()),
        "tol": tol,
        "batch_size": int(batch["input_ids"].shape[0]),
        "tokens": int(batch["attention_mask"].sum()),
    }


def markdown_table(result: dict[str, Any], title: str) -> str:
    lines = [
        f"# Leakage channels: {title}",
        "",
        f"One client step, batch {result['batch_size']} ({result['tokens']} real tokens); span tolerance {result['tol']}.",
        "",
        "| layer | channel | exported | rank / width | overlap (chance) | span hit | decoy hit |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["layers"]:
        if not r["exported"]:
            lines.append(f"| {r['key']} | {r['channel']} | no (frozen) | - | - | 0 | - |")
        else:
            lines.append(
                f"| {r['key']} | {r['channel']} | yes | {r['rank']} / {r['width']} | {r['overlap']:.3f} ({r['chance']:.3f}) "
                f"| {r['span_hit']:.3f} | {r['decoy_hit']:.3f} |"
            )
    e = result["embedding"]
    lines += ["", "## Channel 2: token-embedding rows", ""]
    if e.get("exported"):
        lines += [
            f"- present tokens (non-special): {e['present_tokens']}; non-zero rows: {e['nonzero_rows']} of {e['vocab']}",
            f"- largest / median present-row norm: {e['row_norm_max_over_median']}",
            f"- presence F1 of the non-zero rows: {e['nonzero_f1']:.3f}; of the chi-square test (noise law known): "
            f"{e['chi2_test_f1']:.3f} with {e['chi2_found']} guesses (random guess, same count: {e['random_f1_same_guesses']:.4f})",
        ]
    else:
        lines.append("- not exported")
    return "\n".join(lines) + "\n"
