"""Recovered vs original token embeddings in 2-D PCA, with their cosine similarity (MJP paper
Fig. 9: TAG on Transformer4, Model_shuffle gamma 0.0 / 0.5 and Model_MJP gamma 0.5).

For each trained run, a text attack (TAG by default, batch 1) rebuilds `samples` private test
sentences from one defended client update each (`veil.attacks.harness.attack_once`: the client
steps with its defense, MJP's shuffle included; the server attacks the plain model). For each
sentence the content tokens (no [CLS] / [SEP] / padding) of the original, in the order the
client wrote them, and of the reconstruction, position by position, are looked up in the
model's token-embedding table: the "token embeddings" of the figure are E[v] of the recovered
tokens (TAG's continuous dummies decoded to their nearest tokens), not the dummies themselves.

One PCA (numpy SVD) is fitted per run on the original and recovered embeddings together and
both are projected to 2-D. Reported per run, as means over sentences:

* ``cosine_2d``: the paper's figure number, cos(vec(P_orig), vec(P_rec)) of the two (n, 2)
  projections flattened in position order (n = the shorter of the two lengths);
* ``cosine_full``: the same in the full width D, per position, averaged (no projection);
* the attack's token recovery (same token at the same position) beside them.

A cosine near 1 says the attack's tokens sit where the originals do (a leak); lower values,
and separate clusters in the plot, say the recovered tokens differ. An attack that fails says
nothing about a stronger one: the span attacks rebuild these sentences exactly (docs/results.md).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from veil.attacks import create_attack
from veil.attacks.harness import attack_once, private_batches, score, special_ids, update_seed
from veil.models.base import VeilModel


def content(ids: list[int] | torch.Tensor, special: set[int]) -> list[int]:
    """The ids that are not special tokens, in order."""
    ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
    return [int(i) for i in ids if int(i) not in special]


def project_2d(orig: np.ndarray, rec: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Both sets on the first two principal components of their union; and those components'
    explained-variance ratios."""
    both = np.concatenate([orig, rec])
    mean = both.mean(0, keepdims=True)
    _, s, vt = np.linalg.svd(both - mean, full_matrices=False)
    var = s**2 / max(float((s**2).sum()), 1e-30)
    basis = vt[:2].T
    return (orig - mean) @ basis, (rec - mean) @ basis, var[:2]


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    """cos of the two arrays flattened (0 when one is all zeros)."""
    a, b = a.reshape(-1), b.reshape(-1)
    den = float(np.linalg.norm(a) * np.linalg.norm(b))
    return float(a @ b / den) if den > 0 else 0.0


def rowwise_cosine(a: np.ndarray, b: np.ndarray) -> float:
    """Mean over rows of cos(a_i, b_i)."""
    num = (a * b).sum(-1)
    den = np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1)
    return float(np.mean(np.where(den > 0, num / np.maximum(den, 1e-30), 0.0)))


def recovered_embeddings(
    model: VeilModel,
    data: Any,
    defenses: list,
    attack: str = "tag",
    settings: dict[str, Any] | None = None,
    samples: int = 8,
    seed: int = 0,
    grant: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Attack `samples` test sentences (batch 1) and return the original and recovered content
    tokens' embeddings, their 2-D projections and the cosines (module docstring)."""
    atk = create_attack(attack, **(settings or {}))
    table = model.token_embedding().weight.detach().float().cpu().numpy()
    special = set(special_ids(data))
    orig_all, rec_all, rows = [], [], []
    for i, batch in enumerate(private_batches(data.test, 1, samples, seed)):
        rec, ref, _ = attack_once(atk, model, batch, defenses, data, "original", update_seed(seed, i), grant)
        o = content(batch["input_ids"][0], special)
        r = content((rec.token_ids or [[]])[0], special)
        n = min(len(o), len(r))
        metrics = score(rec, ref, data)
        orig_all.append(table[o[:n]])
        rec_all.append(table[r[:n]])
        rows.append({"tokens": n, "token_recovery": float(metrics.get("token_recovery", float("nan")))})
    orig, rec_e = np.concatenate(orig_all), np.concatenate(rec_all)
    p_orig, p_rec, var = project_2d(orig, rec_e)
    cos2d, cosfull, start = [], [], 0
    for row in rows:
        n = row["tokens"]
        sl = slice(start, start + n)
        row["cosine_2d"] = cosine(p_orig[sl], p_rec[sl]) if n else 0.0
        row["cosine_full"] = rowwise_cosine(orig[sl], rec_e[sl]) if n else 0.0
        cos2d.append(row["cosine_2d"])
        cosfull.append(row["cosine_full"])
        start += n
    return {
        "attack": attack,
        "settings": dict(settings or {}),
        "samples": samples,
        "tokens": int(len(orig)),
        "cosine_2d": float(np.mean(cos2d)),
        "cosine_2d_pooled": cosine(p_orig, p_rec),
        "cosine_full": float(np.mean(cosfull)),
        "token_recovery": float(np.nanmean([r["token_recovery"] for r in rows])),
        "explained_variance_2d": [round(float(v), 4) for v in var],
        "per_sample": rows,
        "points": {"original": p_orig.tolist(), "recovered": p_rec.tolist()},
    }
