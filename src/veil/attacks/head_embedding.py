"""The classifier's input read off its gradient, then matched to candidate inputs: the attacker that
knows a head-only (e.g. DP linear-probing) update.

For a head z = W h + b under cross-entropy and a batch of one (Phong et al., "Privacy-Preserving
Deep Learning via Additively Homomorphic Encryption", 2017, sec. 3; Geiping et al. 2020, Prop. D.1):

    dL/db = p - y,      dL/dW = (p - y) h^T      =>      h = (dL/dW)_k / (dL/db)_k   for any k with (dL/db)_k != 0

so the frozen encoder's output h (for MiniLM: the sentence embedding) leaves the client exactly,
even though no encoder gradient does. The attacker holds the global model, so it embeds a pool of
candidate inputs with the same frozen encoder and returns the candidate whose embedding has the
highest cosine with h (Song & Raghunathan, CCS 2020, "Information Leakage in Embedding Models":
embeddings identify their inputs). k is the class with the largest |dL/db_k| (the least noise
relative to the signal).

For a batch of B > 1, every row of dL/dW is a mixture of the B embeddings,

    dL/dW_k = sum_i (p_ik - y_ik) h_i^T,

so the rows span (part of) span{h_1 .. h_B}: all of it when the classes outnumber the batch
(C - 1 >= B; the rows sum to zero), one direction for a binary head. The attack then runs a
simultaneous orthogonal matching pursuit over the embedded pool (Tropp et al., "Algorithms for
simultaneous sparse approximation", 2006): B times, take the candidate whose unit embedding the
residual rows R point along most (max ||R c|| / ||c||), then remove from dL/dW its projection on the
span of the candidates taken so far. It returns the B candidates (stats: `residual`, the part of
dL/dW the B candidates leave unexplained; 0 when they are the batch and span it).

What it needs is strong: the pool must contain the private input (an attribution / membership
setting); `Knowledge.aux_data["candidates"]` (the text or image split to search; veil's harness grants
the test split the attacked batches are drawn from), optionally with `"candidate_features"`, the pool
already embedded by the same frozen model. Cost: one forward of the pool per attacked update. Under DP-SGD the
noise on dL/dW and dL/db hides h; the guarantee bounds this attacker like any other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from veil.attacks import ATTACKS
from veil.attacks.base import Attack, Knowledge, Observation, Reconstruction, param_names
from veil.attacks.options import Options, option
from veil.errors import VeilError
from veil.models.base import VeilModel
from veil.training.frozen import encoder_features


def embedding_from_head(gW: Tensor, gb: Tensor) -> Tensor:
    """h = dW_k / db_k at the class k with the largest |db_k| (exact for a batch of one)."""
    k = int(gb.abs().argmax())
    if float(gb[k]) == 0.0:
        raise VeilError("head-embedding: the classifier's bias gradient is zero; nothing to read")
    return gW[k] / gb[k]


def pursue(gW: Tensor, pool: Tensor, picks: int) -> tuple[list[int], float]:
    """`picks` pool rows chosen by simultaneous orthogonal matching pursuit on the rows of gW, and
    the fraction of gW's norm the span of the chosen rows leaves unexplained."""
    g = gW.double()
    unit = torch.nn.functional.normalize(pool.double(), dim=1)
    residual, chosen = g, []
    for _ in range(min(picks, len(pool))):  # one step per sentence of the batch, not per token
        fit = (residual @ unit.T).norm(dim=0)
        fit[chosen] = -1.0
        chosen.append(int(fit.argmax()))
        basis, _ = torch.linalg.qr(unit[chosen].T)
        residual = g - (g @ basis) @ basis.T
    return chosen, float(residual.norm() / g.norm().clamp_min(1e-300))


def best_match(h: Tensor, pool: Tensor) -> tuple[int, float, float]:
    """Index of the pool row closest to h in cosine, its cosine, and the margin to the runner-up."""
    cos = torch.nn.functional.cosine_similarity(pool.double(), h.double()[None], dim=1)
    top = torch.topk(cos, min(2, len(cos)))
    margin = float(top.values[0] - top.values[1]) if len(cos) > 1 else float("nan")
    return int(top.indices[0]), float(top.values[0]), margin


@dataclass(frozen=True)
class HeadEmbeddingOptions(Options):
    pool_batch: int = option(256, "candidates embedded per forward pass (memory, not the result)")


class HeadEmbedding(Attack[HeadEmbeddingOptions]):
    """Read the classifier's input off the head gradient; return the matching candidate."""

    modality = "any"
    knows = (
        "the classifier's update and the batch size, the frozen global model, and a pool of candidate inputs that "
        "holds the private ones (Knowledge.aux_data['candidates']); not the defense (naive)"
    )
    observes = frozenset({"gradient", "delta", "candidates"})  # the pool: the test split's inputs
    closed_form = "one read of the head's gradient, one scan of the pool"

    def reads(self, model: VeilModel) -> list[str]:
        """The classifier's weight and bias gradients (its input, matched to the pool)."""
        return param_names(model, [model.classifier()])

    def _reconstruct(self, obs: Observation, know: Knowledge) -> Reconstruction:
        pool = (know.aux_data or {}).get("candidates") if isinstance(know.aux_data, dict) else None
        if pool is None:
            raise VeilError("head-embedding needs a candidate pool: Knowledge.aux_data = {'candidates': split}")
        head = obs.model.classifier()
        if not (obs.has_grad(head, "weight") and obs.has_grad(head, "bias")):
            raise VeilError("head-embedding needs the classifier's weight and bias gradients in the update")
        h = embedding_from_head(obs.grad(head, "weight").detach(), obs.grad(head, "bias").detach())
        feats = know.aux_data.get("candidate_features")  # the pool already embedded by the same frozen model
        if feats is None:
            feats = self._pool_features(obs, pool, h.device)
        i, cos, margin = best_match(h, feats)
        stats = {"cosine": cos, "margin": margin, "pool": len(feats), "batch_one_exact": know.batch_size in (None, 1)}
        picked = [i]
        if (know.batch_size or 1) > 1:  # the rows of dW mix the batch's embeddings: pursue B of them
            picked, stats["residual"] = pursue(obs.grad(head, "weight").detach(), feats, know.batch_size)
        if "input_ids" in pool:
            masks = pool["attention_mask"].bool()
            return Reconstruction(token_ids=[pool["input_ids"][j][masks[j]].tolist() for j in picked], stats=stats)
        return Reconstruction(images=pool["pixels"][picked].clamp(0, 1), stats=stats)

    def _pool_features(self, obs: Observation, pool: dict[str, Tensor], device: torch.device) -> Tensor:
        """The pool's embeddings, computed once per model state: the updates of one cell share the
        weights (an observed step changes no parameter), so the pool is embedded once, not once per update."""
        key = (id(obs.model), tuple(id(v) for v in pool.values()), tuple(p._version for p in obs.model.parameters()))
        cached = getattr(self, "_pool_cache", None)
        if cached is None or cached[0] != key:
            feats = encoder_features(obs.model, pool, self.options.pool_batch, device, progress=False)
            self._pool_cache = (key, feats)
        return self._pool_cache[1]


ATTACKS.register(
    "head-embedding",
    help="the classifier's input read off its gradient (batch 1; a matching pursuit for more), matched to a candidate "
    "pool with the frozen model (needs aux_data candidates)",
)(HeadEmbedding)

__all__ = ["HeadEmbedding", "best_match", "embedding_from_head", "pursue"]
