"""Head / body / tail of a ViT for split learning (p-FeSTA, Fig. 2): the client's patch embedder
(head: patch projection + position embedding), the server's Transformer body ([CLS] + blocks +
final norm, permutation-equivariant over the patch tokens), and task-specific tails.

Built from a registered veil ViT (`vit-digits`, `vit-tiny`, ...) so the same config section
sizes all three; the head's output is exactly the ViT's `tok + pos` for the patch slots.

The head's position embedding (`split.head_pos`): `model` keeps the ViT's learned table (from its
init: random or a `model.init` checkpoint); `sincos` puts fixed 2-D sine-cosine embeddings in its
place (as MAE's ViTs do), which carry the patch positions without training. p-FeSTA freezes the
head, so a learned table stays where its init left it: at a random init (std 0.02) or after a
pretraining that did not need positions, the positions are small beside the patch content and the
body is nearly blind to them (docs/results.md, pfesta-pretrained).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from veil.errors import VeilError
from veil.federated.split.spec import HEAD_POS, SplitSpec
from veil.models import create_model
from veil.models.vit import ViT, patchify, unpatchify


def sincos_2d(grid: int, dim: int) -> Tensor:
    """(grid*grid, dim) fixed 2-D sine-cosine position embeddings, row-major like `patchify`: the
    first half of the features encodes the row, the second the column (MAE's table), in [-1, 1]."""
    if dim % 4:
        raise VeilError(f"split.head_pos=sincos needs a model width divisible by 4, got {dim}")
    q = dim // 4
    omega = 1.0 / 10000 ** (torch.arange(q, dtype=torch.float64) / q)
    rows, cols = torch.meshgrid(
        torch.arange(grid, dtype=torch.float64), torch.arange(grid, dtype=torch.float64), indexing="ij"
    )

    def enc(p: Tensor) -> Tensor:
        angle = p.flatten()[:, None] * omega[None]
        return torch.cat([angle.sin(), angle.cos()], dim=1)

    return torch.cat([enc(rows), enc(cols)], dim=1).float()


class Head(nn.Module):
    """Patch projection + position embedding: pixels (B, C, H, W) -> tokens (B, N, D)."""

    def __init__(self, vit: ViT, pos: str = "model") -> None:
        super().__init__()
        if pos not in HEAD_POS:
            raise VeilError(f"split.head_pos must be one of {', '.join(HEAD_POS)}, got {pos!r}")
        self.patch = vit.cfg.patch_size
        self.proj = nn.Linear(vit.patch_embed.in_features, vit.patch_embed.out_features)
        self.proj.load_state_dict(vit.patch_embed.state_dict())
        table = vit.pos.weight[1:].detach().clone() if pos == "model" else sincos_2d(vit.grid, vit.width)
        self.pos = nn.Parameter(table)

    def forward(self, pixels: Tensor) -> Tensor:
        return self.proj(patchify(pixels, self.patch)) + self.pos


class Body(nn.Module):
    """[CLS] (its own learned embedding) + the ViT's blocks + final norm: (B, N, D) -> (B, 1+N, D)."""

    def __init__(self, vit: ViT) -> None:
        super().__init__()
        self.cls = nn.Parameter((vit.cls.weight + vit.pos.weight[:1]).detach().clone())
        self.blocks = vit.blocks
        self.norm = vit.norm

    def forward(self, tokens: Tensor) -> Tensor:
        h = torch.cat([self.cls.expand(tokens.shape[0], 1, -1), tokens], dim=1)
        for blk in self.blocks:
            h = blk(h)
        return self.norm(h)


class CLSTail(nn.Module):
    """Classification or regression from the [CLS] output (invariant to the patch order)."""

    def __init__(self, dim: int, out: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, out)

    def forward(self, h: Tensor) -> Tensor:
        return self.fc(h[:, 0])


class SegTail(nn.Module):
    """Per-patch mask logits from the patch outputs (in their original order), unpatchified."""

    def __init__(self, dim: int, patch: int, size: int, hidden: int = 64) -> None:
        super().__init__()
        self.patch, self.size = patch, size
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, patch * patch))

    def forward(self, h: Tensor) -> Tensor:
        return unpatchify(self.mlp(h[:, 1:]), self.patch, 1, self.size)


def build_vit(spec: SplitSpec) -> ViT:
    """The spec's ViT, seeded: every party that builds it (server, clients) gets the same weights."""
    torch.manual_seed(spec.cfg.train.seed)
    opts = {k: v for k, v in spec.cfg.model.items() if k != "name"}
    vit = create_model(spec.cfg.model["name"], **{"num_classes": 10, **opts})
    if not isinstance(vit, ViT):
        raise VeilError(f"split learning needs a veil ViT (vit-digits, vit-tiny), got {spec.cfg.model['name']!r}")
    return vit


def build_body(spec: SplitSpec) -> Body:
    """The server's part of the spec's ViT."""
    return Body(build_vit(spec))
