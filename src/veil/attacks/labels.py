"""Label recovery from the last layer's gradient.

For a classifier head z = W h + b trained with mean cross-entropy over a batch of B,

    dL/db = (1/B) sum_b (softmax(z_b) - onehot(y_b)),      dL/dW = (1/B) sum_b (softmax(z_b) - onehot(y_b)) h_b^T.

Batch 1 (iDLG, Zhao et al. 2020): softmax - onehot has exactly one negative entry, at the label,
so the label is argmin dL/db. Without a bias, dL/dW = c h^T is rank one with c = p - y; the label
is the entry of c whose sign differs from the others (read off the top singular pair).

Batch B (LLG-style, Wainakh et al. 2022): every class with a negative bias-gradient entry is in
the batch. Each occurrence of class c lowers dL/db_c by 1/B, on top of a background s (the
probability mass class c receives from the batch, divided by B). We estimate s as the mean of the
positive entries, so the count of class c is about B (s - dL/db_c); the first pass gives one to
each negative entry, the remaining B - k labels go greedily to the class with the largest
remaining estimate (subtracting one unit per pick).
Works for image and text classifiers alike (anything with `classifier()`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from veil.attacks import ATTACKS
from veil.attacks.base import Attack, Knowledge, Observation, Reconstruction, param_names
from veil.errors import VeilError
from veil.models.base import VeilModel, linear_weight


def label_from_weight(dW: Tensor) -> int:
    """Batch 1 without a bias: the odd-signed entry of c in dW = c h^T."""
    U, S, _ = torch.linalg.svd(dW.double(), full_matrices=False)
    c = U[:, 0] * S[0]
    if c.numel() == 2:
        raise VeilError(
            "labels: two classes and no bias gradient leave the label's sign ambiguous; export the head's bias gradient"
        )
    positives = int((c > 0).sum())
    c = c if positives >= c.numel() - positives else -c  # the majority (absent classes, p > 0) is positive
    return int(torch.argmin(c))


def labels_from_bias(db: Tensor, batch_size: int) -> Tensor:
    """The label multiset (sorted) from dL/db of a mean-reduced cross-entropy over `batch_size`."""
    db = db.double().flatten()
    if batch_size == 1:
        return torch.argmin(db).reshape(1)
    neg = db < 0
    picked = torch.nonzero(neg).flatten()[:batch_size]
    background = db[~neg].mean() if (~neg).any() else db.new_tensor(0.0)
    need = batch_size * (background - db)  # estimated count per class
    counts = torch.zeros_like(db)
    counts[picked] = 1.0
    for _ in range(batch_size - picked.numel()):  # at most B small steps over C classes
        c = int(torch.argmax(need - counts))
        counts[c] += 1.0
    return torch.repeat_interleave(torch.arange(db.numel()), counts.long())


def recover_labels(obs: Observation, batch_size: int = 1) -> Tensor:
    """Labels of the private batch (sorted multiset; exact order is not recoverable at B > 1)."""
    head = obs.model.classifier()
    if getattr(head, "bias", None) is not None and obs.has_grad(head, "bias"):
        return labels_from_bias(obs.grad(head, "bias"), batch_size)
    dW = linear_weight(head, obs.grad(head, "weight"))  # one-line error if the weight is missing too
    if batch_size != 1:
        raise VeilError("labels: batch > 1 needs the classifier's bias gradient, which this update does not export")
    return torch.tensor([label_from_weight(dW)])


class LabelRecovery(Attack):
    """iDLG (batch 1) / LLG-style (batch B) label recovery from the classifier's gradient."""

    knows = "the last layer's gradient and the batch size; not the defense (naive)"
    modality = "any"
    observes = frozenset({"gradient", "delta"})
    closed_form = "signs of the head's gradient"

    def applies_to(self, model: VeilModel) -> str | None:
        if model.task != "classification":
            return f"labels recovers class labels; {type(model).__name__} is a {model.task} model"
        return None

    def reads(self, model: VeilModel) -> list[str]:
        """The last layer's bias (else weight) gradient."""
        return param_names(model, [model.classifier()])

    def _reconstruct(self, obs: Observation, know: Knowledge) -> Reconstruction:
        B = int(know.batch_size or 1)
        labels = recover_labels(obs, B)
        return Reconstruction(labels=labels, stats={"batch_size": B})


def label_accuracy(true: Tensor, predicted: Tensor) -> float:
    """Share of the true label multiset that the prediction contains (order-free)."""
    t = torch.bincount(true.flatten().long(), minlength=1)
    p = torch.bincount(predicted.flatten().long(), minlength=t.numel())
    n = max(t.numel(), p.numel())
    t, p = torch.nn.functional.pad(t, (0, n - t.numel())), torch.nn.functional.pad(p, (0, n - p.numel()))
    return float(torch.minimum(t, p).sum()) / max(int(true.numel()), 1)


ATTACKS.register(
    "labels", "label recovery from the classifier's bias/weight gradient (iDLG at batch 1, LLG-style at B)"
)(LabelRecovery)
