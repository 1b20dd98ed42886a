"""A semantic-segmentation set built offline, and how it is scored: the analogue of MJP Table III
(ADE20K mIoU / mAcc of Swin-Tiny + UperNet with and without MJP, `mjp-masked-jigsaw-puzzle.txt`).

``digit-mosaic``: each image is a K x K mosaic of scikit-learn digits (8x8 grey, values / 16),
K = ``grid`` (2: a 16x16 image of 4 digits drawn at random, with replacement, from one side of
a seeded stratified split of the 1,797 digits: the test mosaics use only test digits). The
per-pixel label is the digit's class (0-9) where its ink is at least ``threshold`` (0.25 of
full intensity) and ``background`` (class 10) elsewhere: 11 classes. A pixel's class is
decided by the whole digit around it, not by its own patch (a quarter of a digit is ambiguous),
so the task is position-sensitive like the paper's: tokens must know which others share their
digit. Batch keys: ``pixels`` (N, 1, H, W) in [0, 1] and ``labels`` (N, H, W) int64.

Scores (mmsegmentation's): one confusion matrix over every test pixel, then pixel accuracy
(trace / total: Table III's "Top-1 Acc." on pixels), mIoU (mean over classes of
TP / (TP + FP + FN)) and mAcc (mean over classes of TP / (TP + FN)); a class with no pixel in
the target and none predicted is left out of the means (NaN-mean, as mmseg does). They sit in
the data layer, below training, because `veil.training.loop.evaluate` scores with them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from veil.data.splits import DataSplits, PoolLimits, loader, stratified_split
from veil.errors import VeilError
from veil.registry import DATASETS

BACKGROUND = "background"


def mosaics(images: np.ndarray, labels: np.ndarray, count: int, grid: int, threshold: float, seed: int) -> dict:
    """`count` K x K mosaics of (M, h, w) images in [0, 1] with their per-pixel labels."""
    rng = np.random.default_rng(seed)
    pick = rng.integers(0, len(images), size=(count, grid, grid))
    h, w = images.shape[1:]
    tiles = images[pick]  # (count, K, K, h, w)
    px = tiles.transpose(0, 1, 3, 2, 4).reshape(count, grid * h, grid * w)
    cls = np.broadcast_to(labels[pick][..., None, None], tiles.shape)
    cls = cls.transpose(0, 1, 3, 2, 4).reshape(count, grid * h, grid * w)
    lab = np.where(px >= threshold, cls, 10)
    return {
        "pixels": torch.from_numpy(px).float().unsqueeze(1).contiguous(),
        "labels": torch.from_numpy(lab.astype(np.int64)).contiguous(),
    }


@dataclass(frozen=True, kw_only=True)
class MosaicOptions(PoolLimits):
    """The options of the digit mosaics.

    grid: digits per side (K); the image is 8K x 8K.
    threshold: ink level (of full intensity) from which a pixel carries its digit's class.
    train_size: mosaics drawn from the train digits.
    test_size: mosaics drawn from the test digits.
    test_fraction: share of the 1,797 digits held out for the test mosaics (stratified).
    seed: the split and the draws.
    """

    grid: int = 2
    threshold: float = 0.25
    train_size: int = 2000  # type: ignore[assignment]  # drawn, not a subset: always a number
    test_size: int = 500  # type: ignore[assignment]


@DATASETS.register(
    "digit-mosaic", help="segmentation: 2x2 mosaics of sklearn digits (16x16), per-pixel digit class or background"
)
@loader(MosaicOptions)
def digit_mosaic(o: MosaicOptions) -> DataSplits:
    """K x K mosaics of sklearn digits with per-pixel labels (digit class on ink, background elsewhere)."""
    grid, threshold, train_size, test_size, seed = o.grid, o.threshold, o.train_size, o.test_size, o.seed
    from sklearn.datasets import load_digits

    if isinstance(grid, bool) or not isinstance(grid, int) or grid < 1:
        raise VeilError(f"digit-mosaic grid must be an integer >= 1, got {grid!r}")
    if not 0.0 < float(threshold) <= 1.0:
        raise VeilError(f"digit-mosaic threshold must be in (0, 1], got {threshold!r}")
    for what, n in (("train_size", train_size), ("test_size", test_size)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise VeilError(f"digit-mosaic {what} must be an integer >= 1, got {n!r}")
    d = load_digits()
    images, labels = d.images / 16.0, d.target.astype(np.int64)
    train_idx, test_idx = stratified_split(labels, o.test_fraction, seed)
    train = mosaics(images[train_idx], labels[train_idx], train_size, grid, float(threshold), seed)
    test = mosaics(images[test_idx], labels[test_idx], test_size, grid, float(threshold), seed + 1)
    names = [str(i) for i in range(10)] + [BACKGROUND]
    meta = {
        "source": "sklearn.datasets.load_digits (mosaics)",
        "task": "segmentation",
        "image_size": 8 * grid,
        "channels": 1,
    }
    return DataSplits(train, test, len(names), names, "image", meta)


def confusion_matrix(pred: Tensor, target: Tensor, num_classes: int) -> Tensor:
    """(C, C) int64 counts, rows = target class, columns = predicted class, over all pixels."""
    t, p = target.reshape(-1).long(), pred.reshape(-1).long()
    if t.numel() and (
        int(t.min()) < 0 or int(t.max()) >= num_classes or int(p.min()) < 0 or int(p.max()) >= num_classes
    ):
        raise ValueError(f"class ids outside 0..{num_classes - 1}")
    return torch.bincount(t * num_classes + p, minlength=num_classes**2).reshape(num_classes, num_classes)


def segmentation_scores(confusion: Tensor) -> dict[str, float]:
    """Pixel accuracy, mIoU and mAcc of a confusion matrix (classes absent from both sides skipped)."""
    c = confusion.double()
    tp = c.diag()
    target, predicted = c.sum(1), c.sum(0)
    union = target + predicted - tp
    present = union > 0
    iou = tp[present] / union[present]
    has = target > 0
    acc = tp[has] / target[has]
    total = float(c.sum())
    return {
        "pixel_accuracy": float(tp.sum()) / total if total else 0.0,
        "miou": float(iou.mean()) if iou.numel() else 0.0,
        "mean_accuracy": float(acc.mean()) if acc.numel() else 0.0,
    }
