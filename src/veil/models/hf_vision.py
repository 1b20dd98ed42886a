"""DeiT (Touvron et al. 2021, "Training data-efficient image transformers") behind veil's handles,
loaded from a user's checkpoint folder by `veil.models.hf_path`; ViT is `veil.models.hf.HFViT`.

DeiT is ViT with a second learned token, the distillation token, after [CLS]: the position table
is (1, N + 2, D) and its first two rows belong to those tokens (``pos_offset = 2``), so attacks
that read the patches' rows (APRIL) skip both. `DeiTForImageClassification` classifies from the
[CLS] output alone, as `HFViT` does.
"""

from __future__ import annotations

import torch
from torch import Tensor

from veil.models.hf import HFViT


class HFDeiT(HFViT):
    """DeiTForImageClassification behind veil's handles."""

    base = "deit"
    pos_offset = 2
    legacy_prefixes = {}  # noqa: RUF012 - no checkpoint ever held second module paths

    def leading_tokens(self) -> Tensor:
        """[CLS] and the distillation token, (1, 2, D)."""
        return torch.cat([self._emb.cls_token, self._emb.distillation_token], dim=1)
