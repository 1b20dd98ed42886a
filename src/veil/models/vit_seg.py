"""ViT with a per-patch pixel head for semantic segmentation (the MJP Table III analogue; the paper
puts UperNet on a Swin-Tiny backbone, here a linear head on each patch token, SETR-naive style).

The backbone is veil's `ViT` unchanged ([CLS] + absolute learned positions + pre-LN blocks); the
head maps each patch token's final feature to ``num_classes x p x p`` logits, which are laid back
on the image: output (B, num_classes, H, W), loss = mean per-pixel cross-entropy against
``labels`` (B, H, W).

A shuffle at the embedding step (MJP's jigsaw) moves a token's content to another slot, so the
feature at slot j describes the patch that came from slot perm[j]. The client knows its own
shuffle (MJP's setting: the shuffle and E_unk are the client's), so the head's output at slot j
is put back at the place of the patch it describes: a slot index rides along as one extra
channel through the embedding transform (a transform only reorders tokens) and is read back
after it. Without a transform, or in eval mode (MJP shuffles only in training), it is the
identity. That is the "features un-shuffled before the decoder" of a dense task.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from veil.errors import VeilError
from veil.models import _preset
from veil.models.base import Batch
from veil.models.vit import ViT, ViTConfig, unpatchify


class ViTSeg(ViT):
    """`ViT` whose head predicts every pixel of every patch (task ``segmentation``)."""

    task = "segmentation"

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__(cfg)
        self.head = nn.Linear(cfg.dim, cfg.num_classes * cfg.patch_size**2)
        self._slots: Tensor | None = None

    def embed(self, batch: Batch) -> Tensor:
        tok = self.embed_tokens(batch)
        pos = self.position_embeddings(tok)
        self._slots = None
        if self._embedding_transform is not None:
            B, N, _ = tok.shape
            index = torch.arange(N, device=tok.device, dtype=tok.dtype).expand(B, N).unsqueeze(-1)
            moved, pos = self._embedding_transform(torch.cat([tok, index], dim=-1), pos, self.movable(batch))
            tok, slots = moved[..., :-1], moved[..., -1].detach().round().long()
            if not torch.equal(slots.sort(dim=1).values, torch.arange(N, device=tok.device).expand(B, N)):
                raise VeilError(
                    "the embedding transform changed token values, not only their order; vit-seg needs a reorder"
                )
            self._slots = slots
        return self.assemble(tok, pos, batch)

    def forward_from_embeddings(self, h: Tensor, batch: Batch) -> Tensor:
        for blk in self.blocks:
            h = blk(h)
        out = self.head(self.norm(h)[:, 1:])  # (B, N, classes * p * p), slot order
        slots, self._slots = self._slots, None
        if slots is not None:  # back to the patches' own places: placed[:, slots[:, j]] = out[:, j]
            placed = torch.empty_like(out)
            placed.scatter_(1, slots.unsqueeze(-1).expand_as(out), out)
            out = placed
        # each token's logits are (classes, p, p), the channel layout `patchify` gives a patch
        return unpatchify(out, self.cfg.patch_size, self.cfg.num_classes, self.cfg.image_size)

    def loss(self, logits: Tensor, batch: Batch) -> Tensor:
        return nn.functional.cross_entropy(logits, batch["labels"], label_smoothing=self.label_smoothing)


_preset(
    "vit-seg",
    ViTSeg,
    ViTConfig,
    "ViT with a per-patch pixel head (segmentation) for 16x16 grey: patch 4, width 64, depth 4",
    image_size=16,
    patch_size=4,
    in_chans=1,
    dim=64,
    depth=4,
    heads=4,
    mlp_ratio=2.0,
)
