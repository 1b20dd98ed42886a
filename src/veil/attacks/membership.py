"""Membership inference against a released classifier: the loss-threshold attack (Yeom et al.,
CSF 2018, "Privacy Risk in Machine Learning: Analyzing the Connection to Overfitting", Sec. 3.2:
guess "member" when the loss is low) and LiRA's offline variant with reference models (Carlini et
al., IEEE S&P 2022, "Membership Inference Attacks From First Principles", Sec. IV, Alg. 1
offline; difficulty calibration as in Watson et al., ICLR 2022).

Per example (x, y) the attacker reads the model's logit-scaled confidence on the true label,

    phi(x, y) = log p_y - log(1 - p_y) = z_y - logsumexp_{c != y} z_c          (LiRA eq. 4)

which is close to Gaussian over training runs. Loss attack: score = log p_y (= minus the loss).
LiRA offline: reference models trained by the attacker as the target was (same recipe, same
defense: the attacker knows the mechanism) on random halves of a population that holds the
candidates; for each candidate the references that did NOT train on it give mu_out(x); with few
references one global sigma_out (their Sec. VI-C: fixed variance for small budgets) and

    score = (phi_target(x) - mu_out(x)) / sigma_out                              (one-sided test)

A candidate no reference left out gets the mean over all OUT observations. The scores go to
`veil.metrics.membership` (TPR at low FPR, ROC).
"""

from __future__ import annotations

import torch
from torch import Tensor

from veil.data import iterate_batches
from veil.errors import VeilError
from veil.models.base import VeilModel


@torch.no_grad()
def confidence_logits(model: VeilModel, split: dict[str, Tensor], batch_size: int = 256) -> Tensor:
    """phi(x, y) for every sample of `split` (N,), float64, the model in eval mode."""
    was = model.training
    model.eval()
    out = []
    for batch in iterate_batches(split, batch_size):
        z = model(batch).double()
        if z.dim() != 2:
            raise VeilError(f"membership inference needs a classifier (logits of shape (B, C)), got {tuple(z.shape)}")
        y = batch["labels"]
        zy = z.gather(1, y[:, None])[:, 0]
        rest = z.scatter(1, y[:, None], float("-inf")).logsumexp(1)
        out.append(zy - rest)
    model.train(was)
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.float64)


def loss_scores(phi: Tensor) -> Tensor:
    """The loss attack's score, log p_y = -log(1 + e^-phi) (higher: member)."""
    return -torch.nn.functional.softplus(-phi)


def lira_offline(phi: Tensor, reference: Tensor, trained_on: Tensor) -> Tensor:
    """LiRA offline scores: `phi` (N,) of the target; `reference` (K, N) phi of K reference
    models; `trained_on` (K, N) bool, whether reference k trained on candidate n."""
    if reference.dim() != 2 or reference.shape != trained_on.shape or reference.shape[1] != phi.shape[0]:
        raise VeilError(
            f"LiRA needs reference phi (K, N) and membership (K, N) for N = {phi.shape[0]}, got "
            f"{tuple(reference.shape)} and {tuple(trained_on.shape)}"
        )
    out = ~trained_on
    if not bool(out.any()):
        raise VeilError("LiRA offline needs reference models that did not train on the candidates")
    count = out.sum(0)
    mu = torch.where(out, reference, 0).sum(0) / count.clamp_min(1)
    mu = torch.where(count > 0, mu, reference[out].mean())
    dev = torch.where(out, reference - mu, 0)
    dof = int(out.sum()) - int((count > 0).sum())  # each candidate's own mean costs one degree of freedom
    sigma = (dev.square().sum() / dof).sqrt() if dof > 0 else reference[out].std(correction=0)
    sigma = sigma.clamp_min(1e-6)
    return (phi - mu) / sigma
