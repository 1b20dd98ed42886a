"""Image reconstruction quality: MSE, PSNR, SSIM, FFT2D.

All functions take ``original`` and ``reconstruction`` as float tensors of shape ``(B, C, H, W)``
with values in ``[0, 1]`` (data range 1), compare item ``b`` with item ``b``, compute the score
per image and return the mean over the batch as a Python float. Use `image_report` to first
pair the items by Hungarian matching on MSE.

Definitions:

* MSE: ``mean((x - y)^2)`` over C, H, W, then mean over the batch.
* PSNR: ``10 log10(1 / MSE)`` per image (data range 1), then mean over the batch; identical to
  ``torchmetrics.functional.peak_signal_noise_ratio(..., data_range=1.0, dim=(1, 2, 3))``.
  An exact reconstruction has PSNR ``inf``.
* SSIM (Wang et al. 2004, "Image quality assessment: from error visibility to structural
  similarity"): ``torchmetrics.functional.structural_similarity_index_measure`` with a gaussian
  window, data range 1, averaged over the map and the batch. The usual window is 11x11,
  sigma 1.5; small images (e.g. 8x8) cannot hold it, so the window is
  ``k = min(11, largest odd number <= min(H, W))`` with ``sigma = 1.5 * k / 11``. (torchmetrics
  sizes its gaussian window from sigma as ``2 * int(3.5 * sigma + 0.5) + 1``; this sigma gives
  exactly ``k``.) Images smaller than 3x3 are rejected.
* FFT2D, as defined in the MJP paper on gradient inversion of vision transformers: the cosine
  similarity between the magnitude spectra ``|FFT2(x)|`` and ``|FFT2(y)|`` of original and
  reconstruction (2-D FFT over H, W of each channel; the C x H x W magnitudes flattened into
  one vector per image), then mean over the batch. 1 means identical spectra; higher is better.

What leaks under a patch shuffle (MJP), `patch_report`, given the true (B, N) mask of masked
(shuffled) slots on the row-major patch grid, which only the evaluator knows:

* psnr_unshuffled: PSNR over the pixels of the unmasked patches, each at its own position
  (they never move), per image, then the batch mean.
* ssim_unshuffled: SSIM of the original against the reconstruction with its masked patches
  replaced by the original's: only the errors of the unmasked patches count.
* psnr_masked_set: the masked patches as a set: the original's patches at the masked slots and the
  reconstruction's are paired by Hungarian matching on per-patch MSE (`veil.metrics.matching`);
  PSNR of the mean matched MSE, per image, then the batch mean (images with a masked slot only).
* The whole-image ``psnr`` / ``ssim`` above score the masked patches' order too, which the update
  does not determine (the network's output is the same for any order of the masked patches):
  under MJP they are bounded by the hidden order, not by what leaks.

These PSNRs floor the MSE at ``PATCH_MSE_FLOOR`` = 1e-16 (160 dB): a set of background patches
recovered exactly (after clamping) would otherwise score infinity.
"""

from __future__ import annotations

import numpy as np
import torch
from torchmetrics.functional.image import structural_similarity_index_measure

from veil.metrics.matching import MetricInputError, hungarian_match, order_from_match

IMAGE_KEYS: tuple[str, ...] = ("mse", "psnr", "ssim", "fft2d")

_RANGE_TOL = 1e-4


def _check_images(x: torch.Tensor, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise MetricInputError(f"{name} must be a torch.Tensor of shape (B, C, H, W), got {type(x).__name__}")
    if x.ndim != 4:
        raise MetricInputError(f"{name} must have shape (B, C, H, W), got shape {tuple(x.shape)}")
    if x.shape[0] == 0:
        raise MetricInputError(f"{name} is an empty batch (shape {tuple(x.shape)})")
    if not x.is_floating_point():
        raise MetricInputError(f"{name} must be a float tensor in [0, 1], got dtype {x.dtype}")
    x = x.detach()
    if not torch.isfinite(x).all():
        raise MetricInputError(f"{name} contains NaN or infinite values")
    lo, hi = float(x.min()), float(x.max())
    if lo < -_RANGE_TOL or hi > 1 + _RANGE_TOL:
        raise MetricInputError(
            f"{name} must have values in [0, 1] (data range 1), got [{lo:.4g}, {hi:.4g}]; clamp or rescale it first"
        )
    return x


def _check_pair(
    original: torch.Tensor, reconstruction: torch.Tensor, *, same_batch: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    x = _check_images(original, "original")
    y = _check_images(reconstruction, "reconstruction")
    if same_batch and x.shape != y.shape:
        raise MetricInputError(
            f"original and reconstruction must have the same shape, got {tuple(x.shape)} and {tuple(y.shape)}"
        )
    if not same_batch and x.shape[1:] != y.shape[1:]:
        raise MetricInputError(
            f"original and reconstruction must have the same (C, H, W), got {tuple(x.shape[1:])} and {tuple(y.shape[1:])}"
        )
    dtype = torch.promote_types(x.dtype, y.dtype)
    return x.to(dtype), y.to(device=x.device, dtype=dtype)


def _per_image_mse(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (x - y).pow(2).flatten(1).mean(dim=1)


def mse(original: torch.Tensor, reconstruction: torch.Tensor) -> float:
    """Mean squared error per image, averaged over the batch. Lower is better."""
    x, y = _check_pair(original, reconstruction)
    return float(_per_image_mse(x, y).mean())


def psnr(original: torch.Tensor, reconstruction: torch.Tensor) -> float:
    """Peak signal-to-noise ratio in dB, ``10 log10(1 / MSE)`` per image (data range 1), batch mean.

    Matches ``torchmetrics`` ``peak_signal_noise_ratio(data_range=1.0, dim=(1, 2, 3))``.
    Returns ``inf`` if some image is reconstructed exactly. Higher is better.
    """
    x, y = _check_pair(original, reconstruction)
    per_image = 10.0 * torch.log10(1.0 / _per_image_mse(x, y))
    return float(per_image.mean())


def ssim_window(height: int, width: int) -> tuple[int, float]:
    """The SSIM gaussian window ``(kernel_size, sigma)`` used for ``height x width`` images.

    ``kernel_size = min(11, largest odd <= min(height, width))``, ``sigma = 1.5 * kernel_size / 11``.
    """
    side = min(height, width)
    if side < 3:
        raise MetricInputError(f"ssim needs images of at least 3x3 pixels, got {height}x{width}")
    k = min(11, side if side % 2 == 1 else side - 1)
    sigma = 1.5 * k / 11
    assert 2 * int(3.5 * sigma + 0.5) + 1 == k  # torchmetrics derives the window size from sigma
    return k, sigma


def ssim(original: torch.Tensor, reconstruction: torch.Tensor) -> float:
    """Structural similarity (Wang et al. 2004) via torchmetrics, data range 1, batch mean.

    Window: see `ssim_window` (11x11, sigma 1.5 unless the image is smaller). Higher is better.
    """
    x, y = _check_pair(original, reconstruction)
    k, sigma = ssim_window(x.shape[-2], x.shape[-1])
    value = structural_similarity_index_measure(
        y, x, gaussian_kernel=True, sigma=sigma, kernel_size=k, data_range=1.0, reduction="elementwise_mean"
    )
    return float(value)


def fft2d(original: torch.Tensor, reconstruction: torch.Tensor) -> float:
    """FFT2D (MJP paper): cosine similarity of the 2-D FFT magnitude spectra, batch mean.

    For each image, ``|torch.fft.fft2(x)|`` (over H, W, per channel) is flattened to one vector
    of C*H*W magnitudes; the score is the cosine similarity between the original's and the
    reconstruction's vectors (eps 1e-8 in the denominator), averaged over the batch.
    """
    x, y = _check_pair(original, reconstruction)
    fx = torch.fft.fft2(x.double()).abs().flatten(1)
    fy = torch.fft.fft2(y.double()).abs().flatten(1)
    cos = torch.nn.functional.cosine_similarity(fx, fy, dim=1, eps=1e-8)
    return float(cos.mean())


def pairwise_mse(original: torch.Tensor, reconstruction: torch.Tensor) -> torch.Tensor:
    """``(n_original, n_reconstruction)`` matrix of per-pair MSE (float64, on CPU)."""
    x, y = _check_pair(original, reconstruction, same_batch=False)
    a = x.double().flatten(1).cpu()
    b = y.double().flatten(1).cpu()
    sq = (a * a).sum(1)[:, None] + (b * b).sum(1)[None, :] - 2.0 * a @ b.T
    return sq.clamp_min(0.0) / a.shape[1]


def image_report(
    original: torch.Tensor, reconstruction: torch.Tensor, match: bool = True
) -> dict[str, float | list[int]]:
    """All image scores after pairing reconstructions with originals.

    With ``match=True`` items are paired by Hungarian matching on per-pair MSE, and the
    reconstruction may have a different batch size than the original: only the
    ``min(n_original, n_reconstruction)`` matched pairs are scored. With ``match=False`` item
    ``b`` is compared with item ``b`` and the shapes must be equal.

    Returns:
        ``{"mse", "psnr", "ssim", "fft2d"}`` as floats, plus ``"order"``: for each original ``i``,
        the index of the reconstruction it was paired with (``-1`` if left unmatched).
    """
    x, y = _check_pair(original, reconstruction, same_batch=not match)
    n = x.shape[0]
    if match:
        rows, cols = hungarian_match(pairwise_mse(x, y))
    else:
        rows = cols = np.arange(n, dtype=np.int64)
    xi = x[torch.as_tensor(rows, device=x.device)]
    yi = y[torch.as_tensor(cols, device=y.device)]
    report: dict[str, float | list[int]] = {
        "mse": mse(xi, yi),
        "psnr": psnr(xi, yi),
        "ssim": ssim(xi, yi),
        "fft2d": fft2d(xi, yi),
    }
    report["order"] = order_from_match(rows, cols, n)
    return report


PATCH_MSE_FLOOR = 1e-16


def _grid_patches(x: torch.Tensor, n: int) -> torch.Tensor:
    """(B, C, H, W) -> (B, n, C*p*p) on a square grid of n patches, row-major."""
    B, C, H, W = x.shape
    k = int(round(n**0.5))
    if k * k != n or H % k or W % k:
        raise MetricInputError(f"patch_report: a mask of {n} slots is not a square grid dividing {H}x{W} images")
    p, q = H // k, W // k
    return x.reshape(B, C, k, p, k, q).permute(0, 2, 4, 1, 3, 5).reshape(B, n, C * p * q)


def _psnr_of(mse_value: torch.Tensor) -> float:
    return float(10.0 * torch.log10(1.0 / mse_value.clamp_min(PATCH_MSE_FLOOR)))


def patch_report(original: torch.Tensor, reconstruction: torch.Tensor, masked: torch.Tensor) -> dict[str, float]:
    """Scores of what leaks under a patch shuffle; items are compared b with b (pair them first).

    Args:
        original, reconstruction: (B, C, H, W) in [0, 1].
        masked: (B, N) bool, the slots that were masked (shuffled) in the client's step.

    Returns ``psnr_unshuffled`` and ``ssim_unshuffled`` (when some slot is unmasked) and
    ``psnr_masked_set`` (when some slot is masked); see the module docstring.
    """
    x, y = _check_pair(original, reconstruction)
    masked = torch.as_tensor(masked, dtype=torch.bool, device=x.device)
    if masked.ndim != 2 or masked.shape[0] != x.shape[0]:
        raise MetricInputError(
            f"patch_report: masked must be (B, N) with B = {x.shape[0]}, got shape {tuple(masked.shape)}"
        )
    px, py = _grid_patches(x.double(), masked.shape[1]), _grid_patches(y.double(), masked.shape[1])
    out: dict[str, float] = {}
    err = (px - py).pow(2).mean(-1)  # (B, N) per-patch MSE
    keep = ~masked
    has = keep.any(1)
    if bool(has.any()):
        per = (err * keep).sum(1)[has] / keep.sum(1)[has]
        out["psnr_unshuffled"] = sum(_psnr_of(v) for v in per) / len(per)
        filled = torch.where(masked.unsqueeze(-1), px, py)
        out["ssim_unshuffled"] = ssim(x[has], _ungrid(filled, x.shape)[has].to(x.dtype))
    sets = [_masked_set_mse(px[b][masked[b]], py[b][masked[b]]) for b in range(x.shape[0]) if bool(masked[b].any())]
    if sets:  # one Hungarian matching per image (B is small: one client update)
        out["psnr_masked_set"] = sum(_psnr_of(v) for v in sets) / len(sets)
    return out


def _ungrid(patches: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    B, C, H, W = shape
    n = patches.shape[1]
    k = int(round(n**0.5))
    p, q = H // k, W // k
    return patches.reshape(B, k, k, C, p, q).permute(0, 3, 1, 4, 2, 5).reshape(B, C, H, W)


def _masked_set_mse(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Mean per-patch MSE of the best one-to-one pairing of patch sets a and b, (m, P) each."""
    cost = torch.cdist(a, b).pow(2) / a.shape[1]
    rows, cols = hungarian_match(cost)
    return cost[torch.as_tensor(rows), torch.as_tensor(cols)].mean()
