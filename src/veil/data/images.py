"""Image data sets that need no download: sklearn digits, skimage LFW faces, a user's folder.

Every loader returns ``pixels`` float32 (N, C, H, W) in [0, 1] and ``labels`` int64 (N,), split
train/test by a seeded, stratified draw.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor
from torch.nn import functional as F

from veil.data.splits import DataSplits, PoolLimits, limit, loader, stratified_split, subset
from veil.errors import VeilError
from veil.registry import DATASETS

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif")


def resize(pixels: Tensor, size: int) -> Tensor:
    """Bilinear resize of (N, C, H, W) to size x size, kept in [0, 1]."""
    if size < 1:
        raise VeilError(f"image size must be at least 1, got {size}")
    if pixels.shape[-2:] == (size, size):
        return pixels
    out = F.interpolate(pixels, size=(size, size), mode="bilinear", align_corners=False, antialias=True)
    return out.clamp_(0.0, 1.0)


def set_channels(pixels: Tensor, channels: int) -> Tensor:
    """Grey (C=1) repeated to RGB or RGB averaged to grey, so any model's `in_chans` fits."""
    if channels not in (1, 3):
        raise VeilError(f"channels must be 1 or 3, got {channels}")
    have = pixels.shape[1]
    if have == channels:
        return pixels
    return pixels.expand(-1, 3, -1, -1).contiguous() if channels == 3 else pixels.mean(1, keepdim=True)


@dataclass(frozen=True, kw_only=True)
class ImageOptions(PoolLimits):
    """The options of an image loader.

    size: side, in pixels, the images are resized to (square).
    channels: 1 (grey) or 3 (RGB).
    """

    size: int = 32
    channels: int = 1


@dataclass(frozen=True, kw_only=True)
class DigitsOptions(ImageOptions):
    size: int = 8


@dataclass(frozen=True, kw_only=True)
class FolderOptions(ImageOptions):
    """path: a folder with one sub-folder of images per class."""

    path: str | Path
    channels: int = 3


def build_splits(pixels: Tensor, labels: np.ndarray, class_names: list[str], lim: PoolLimits, meta: dict) -> DataSplits:
    """Seeded stratified split, then optional seeded size limits."""
    data = {"pixels": pixels.float().contiguous(), "labels": torch.as_tensor(labels, dtype=torch.int64)}
    train_idx, test_idx = stratified_split(labels, lim.test_fraction, lim.seed)
    train = limit(subset(data, train_idx), lim.train_size, lim.seed, "train_size")
    test = limit(subset(data, test_idx), lim.test_size, lim.seed + 1, "test_size")
    meta = {**meta, "image_size": int(pixels.shape[-1]), "channels": int(pixels.shape[1])}
    return DataSplits(train, test, len(class_names), class_names, "image", meta)


def read_digits() -> tuple[Tensor, np.ndarray, list[str], str]:
    """sklearn handwritten digits (8x8, values 0..16 scaled to [0, 1]); bundled, no download."""
    from sklearn.datasets import load_digits

    d = load_digits()
    pixels = torch.from_numpy(d.images / 16.0).float().unsqueeze(1)
    return pixels, d.target.astype(np.int64), [str(i) for i in range(10)], "sklearn.datasets.load_digits"


def read_lfw() -> tuple[Tensor, np.ndarray, list[str], str]:
    """Face / non-face task from skimage's bundled LFW subset (first 100 faces, then 100 not)."""
    from skimage import data as skdata

    images = skdata.lfw_subset()  # (200, 25, 25) float64 in [0, 1]
    labels = np.repeat(np.array([1, 0], dtype=np.int64), [100, 100])
    return torch.from_numpy(images).float().unsqueeze(1), labels, ["non-face", "face"], "skimage.data.lfw_subset"


#: a bundled set's reader: () -> (pixels (N, C, H, W) in [0, 1], labels, class names, source)
Reader = Callable[[], tuple[Tensor, np.ndarray, list[str], str]]


def bundled(name: str, read: Reader, options: type[ImageOptions]) -> Callable[..., DataSplits]:
    """The loader of an image set a dependency bundles: `read` gives (pixels, labels, classes, source)."""

    def load(o: ImageOptions) -> DataSplits:
        pixels, labels, names, source = read()
        return build_splits(set_channels(resize(pixels, o.size), o.channels), labels, names, o, {"source": source})

    load.__name__ = load.__qualname__ = name
    load.__doc__ = read.__doc__
    return loader(options)(load)


#: the bundled image sets: name -> (help, reader, options)
BUNDLED: dict[str, tuple[str, Reader, type[ImageOptions]]] = {
    "digits": ("sklearn handwritten digits, 1,797 8x8 grey images, 10 classes", read_digits, DigitsOptions),
    "lfw": ("skimage LFW subset: 100 faces vs 100 non-faces, 25x25 grey", read_lfw, ImageOptions),
}
for _name, (_help, _read, _options) in BUNDLED.items():
    DATASETS.register(_name, help=_help)(bundled(_name, _read, _options))


def read_image(path: Path, channels: int) -> Tensor:
    """One image file as float (C, H, W) in [0, 1]; a file that cannot be decoded is a VeilError."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as im:
            arr = np.asarray(im.convert("L" if channels == 1 else "RGB"), dtype=np.float32) / 255.0
    except (UnidentifiedImageError, OSError, ValueError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise VeilError(f"cannot read image {str(path)!r}: {reason}") from None
    return torch.from_numpy(arr).reshape(arr.shape[0], arr.shape[1], -1).permute(2, 0, 1)


def class_files(root: Path) -> dict[str, list[Path]]:
    """Image files under each class sub-folder of `root`, checked for the usual mistakes."""
    if not root.exists():
        raise VeilError(f"image folder {str(root)!r} does not exist")
    if not root.is_dir():
        raise VeilError(f"image folder {str(root)!r} is not a folder; give a folder with one sub-folder per class")
    folders = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not folders:
        raise VeilError(f"no class folders in {str(root)!r}; put each class's images in its own sub-folder")
    files = {}
    for d in folders:
        found = sorted(p for p in d.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
        if not found:
            raise VeilError(f"class folder {str(d)!r} holds no images ({', '.join(IMAGE_SUFFIXES)})")
        files[d.name] = found
    if len(files) < 2:
        raise VeilError(f"image folder {str(root)!r} has {len(files)} class folder; a classifier needs at least 2")
    return files


@DATASETS.register("image_folder", help="your images: one sub-folder per class (png/jpg)")
@loader(FolderOptions)
def image_folder(o: FolderOptions) -> DataSplits:
    """A user's images, one sub-folder per class (sorted names are the classes), resized to `size`."""
    if o.channels not in (1, 3):
        raise VeilError(f"channels must be 1 or 3, got {o.channels}")
    files = class_files(Path(o.path))
    names = list(files)
    pixels = torch.cat([resize(read_image(p, o.channels)[None], o.size) for c in names for p in files[c]])
    labels = np.repeat(np.arange(len(names), dtype=np.int64), [len(files[c]) for c in names])
    return build_splits(pixels, labels, names, o, {"source": str(o.path)})
