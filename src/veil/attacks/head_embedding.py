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
relative to the signal). For a batch of B > 1, dL/dW mixes the B embeddings: the attack then
returns the best single candidate of the mixture (weak; said in its stats).

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
from veil.attacks.base import Attack, Knowledge, Observation, Reconstruction
from veil.attacks.options import Options, option
from veil.errors import VeilError
from veil.training.frozen import encoder_features


def embedding_from_head(gW: Tensor, gb: Tensor) -> Tensor:
    """h = dW_k / db_k at the class k with the largest |db_k| (exact for a batch of one)."""
    k = int(gb.abs().argmax())
    if float(gb[k]) == 0.0:
        raise VeilError("head-embedding: the classifier's bias gradient is zero; nothing to read")
    return gW[k] / gb[k]


def best_match(h: Tensor, pool: Tensor) -> tuple[int, float, float]:
    """Index of the pool row closest to h in cosine, its cosine, and the margin to the runner-up."""
    cos = torch.nn.functional.cosine_similarity(pool.double(), h.double()[None], dim=1)
    top = torch.topk(cos, min(2, len(cos)))
    margin = float(top.values[0] - top.values[1]) if len(cos) > 1 else float("nan")
    return int(top.indices[0]), float(top.values[0]), margin


@dataclass(frozen=True)
class HeadEmbeddingOptions(Options):
    pool_batch: int = option(256, "candidates embedded per forward pass (memory, not the result)")


class HeadEmbedding(Attack):
    """Read the classifier's input off the head gradient; return the matching candidate."""

    name = "head-embedding"
    modality = "any"
    knows = (
        "the classifier's update (batch 1), the frozen global model, and a pool of candidate inputs that holds the "
        "private one (Knowledge.aux_data['candidates']); not the defense (naive)"
    )
    options_type = HeadEmbeddingOptions
    options: HeadEmbeddingOptions
    needs_pool = True  # veil's harness grants the test split's inputs, which hold the attacked batch
    closed_form = "one read of the head's gradient, one scan of the pool"

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
        if "input_ids" in pool:
            ids = pool["input_ids"][i][pool["attention_mask"][i].bool()].tolist()
            return Reconstruction(token_ids=[ids], stats=stats)
        return Reconstruction(images=pool["pixels"][i : i + 1].clamp(0, 1), stats=stats)

    def _pool_features(self, obs: Observation, pool: dict[str, Tensor], device: torch.device) -> Tensor:
        """The pool's embeddings, computed once per model state: the updates of one cell share the
        weights (an observed step changes no parameter), so re-embedding the pool for each was repeated work."""
        key = (id(obs.model), tuple(id(v) for v in pool.values()), tuple(p._version for p in obs.model.parameters()))
        cached = getattr(self, "_pool_cache", None)
        if cached is None or cached[0] != key:
            feats = encoder_features(obs.model, pool, self.options.pool_batch, device, progress=False)
            self._pool_cache = (key, feats)
        return self._pool_cache[1]


ATTACKS.register(
    "head-embedding",
    help="the classifier's input read off its gradient (batch 1), matched to a candidate "
    "pool with the frozen model (needs aux_data candidates)",
)(HeadEmbedding)

__all__ = ["HeadEmbedding", "best_match", "embedding_from_head"]
