"""Sparse rows: which token-embedding rows some client used, read from an aggregate of updates
(the vocabulary filter of DAGER, Petrov et al., NeurIPS 2024, sec. 4.1, and the bag-of-words leak
of LAMP, Balunovic et al., NeurIPS 2022, applied to the sum that secure aggregation reveals).

Row v of the token-embedding gradient is sum_i onehot(x_i = v) (dL/de_i)^T: zero unless token v
occurs in the batch. Summing the updates of N clients keeps that sparsity (a row is non-zero iff
some client used token v), so secure aggregation hides who used a token, not that it was used.
Two things blur the zeros, and this attacker knows both mechanisms:

* decoupled weight decay (AdamW, every local step): an unused row moves by -lr wd w_v per step,
  so its pseudo-gradient is parallel to the row's current weights. The attack keeps the residual
  orthogonal to w_v,  r_v = g_v - (g_v . w_v / ||w_v||^2) w_v,  which is exactly zero for an
  unused row whatever lr, wd and the step count were (eq. R);
* SecAgg+'s stochastic quantization (or DP noise): every entry of the sum carries a small
  independent error, so unused rows have small non-zero residuals. Most of a vocabulary is
  unused in a round, so their residual norms set the floor: a row is used when

      ||r_v|| > max( median_u ||r_u|| + z * 1.4826 * MAD_u ||r_u||,  rel_tol * max_u ||r_u|| )   (eq. T)

  (median and median absolute deviation: robust to the used rows; z = ``z``). Where the
  attacker is granted the aggregation's per-entry error std bound s (SecAgg+'s stochastic
  rounding: sqrt(N) (c / q) / sum_i r_i, `veil.federated.fedavg.secagg.error_std`, as
  ``Knowledge.defense["secagg"]["entry_std"]``), an unused row's residual norm concentrates
  below sqrt(D) s (D the embedding width, independent zero-mean errors). That bound is loose where
  the summed values sit on the quantization grid (an unused row of a gradient is exactly 0, which
  rounds exactly) and the median floor is then the lower one; the median floor fails once most of
  the vocabulary is used in the round, and the bound is then the lower one. A row is used when it
  clears either floor (eq. T or):

      ||r_v|| > max( margin * sqrt(D) * s,  rel_tol * max_u ||r_u|| )                         (eq. T')

The result is the bag of tokens of every sampled client's batch, less the special tokens unless
``keep_special``. A gradient (fedsgd) has no weight-decay part; eq. (R) is then skipped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from veil.attacks import ATTACKS
from veil.attacks.base import Attack, Knowledge, Observation, Reconstruction
from veil.attacks.options import Options, option
from veil.attacks.presence import ReadsEmbeddingRows, embedding_row_norms, token_bag


def decay_free_rows(grad: Tensor, weight: Tensor) -> Tensor:
    """Eq. (R): each row of `grad` less its projection on the same row of `weight` (vectorised)."""
    g, w = grad.float(), weight.detach().float()
    ww = (w * w).sum(dim=1, keepdim=True)
    coef = torch.where(ww > 0, (g * w).sum(dim=1, keepdim=True) / ww.clamp_min(1e-30), torch.zeros_like(ww))
    return g - coef * w


def used_rows(norms: Tensor, z: float, rel_tol: float) -> Tensor:
    """Eq. (T): ids of the rows above the robust noise floor of the row norms."""
    if norms.numel() == 0 or float(norms.max()) <= 0.0:
        return torch.zeros(0, dtype=torch.long)
    med = norms.median()
    mad = (norms - med).abs().median()
    floor = max(float(med + z * 1.4826 * mad), rel_tol * float(norms.max()))
    return torch.nonzero(norms > floor).flatten()


@dataclass(frozen=True)
class SparseRowsOptions(Options):
    z: float = option(8.0, "a row is used when its residual norm exceeds median + z x 1.4826 x MAD of all rows")
    rel_tol: float = option(1e-6, "and exceeds rel_tol x the largest residual norm")
    decay: bool = option(True, "remove each row's weight-decay component (its projection on the row's weights)")
    keep_special: bool = option(False, "keep the special tokens ([CLS], [SEP], padding) in the bag")
    margin: float = option(2.0, "eq. (T'): a row is used above margin x sqrt(width) x the known per-entry error std")


@ATTACKS.register(
    "sparse-rows", help="tokens some client used, from the non-zero token-embedding rows of an (aggregated) update"
)
class SparseRowsAttack(ReadsEmbeddingRows, Attack[SparseRowsOptions]):
    """Token bag of every client in an aggregate (options: `SparseRowsOptions`)."""

    knows = "the token-embedding rows of the update (one client's or the aggregate), weight decay and quantization noise as mechanisms"

    def _reconstruct(self, obs: Observation, know: Knowledge) -> Reconstruction:
        embedding_row_norms(obs)  # the one-line refusals: tied, frozen, not a table
        emb = obs.model.token_embedding()
        g = obs.grad(emb).float()
        if self.options.decay and obs.kind == "delta":
            g = decay_free_rows(g, emb.weight)
        norms = g.norm(dim=1)
        found = set(used_rows(norms, self.options.z, self.options.rel_tol).tolist())
        entry = (know.defense.get("secagg") or {}).get("entry_std")
        if entry is not None and norms.numel() and float(norms.max()) > 0:  # eq. (T'): the mechanism's floor
            floor = max(
                self.options.margin * float(entry) * g.shape[1] ** 0.5, self.options.rel_tol * float(norms.max())
            )
            found |= set(torch.nonzero(norms > floor).flatten().tolist())
        keep = self.options.keep_special
        return token_bag(found, obs, know, keep, z=self.options.z, keep_special=keep)
