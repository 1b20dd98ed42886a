"""ResNet-style CNN: 3x3 stem -> stages of basic residual blocks (two 3x3 convolutions and a
skip; each stage after the first halves the resolution and doubles the width) -> global
average pool -> linear head (He et al. 2016, scaled down for 8x8 to 32x32 inputs).

GroupNorm instead of BatchNorm: batch statistics would couple the samples of a batch (per-sample
gradients for DP-SGD, and a gradient-inversion attacker would have to model them), which is why
federated and DP work on ResNets uses group or layer norms.

Tokens for the embedding-step defenses are the image's ``patch_size`` x ``patch_size`` pixel
patches: `embed_tokens` cuts them out, `assemble` puts them back into an image. A CNN has no
position embeddings (`position_embeddings` is zero, `position_table` refuses), so MJP on it is
the patch shuffle alone, as the MJP paper does for ResNet-50 (its Table I); the convolutions see
where each patch landed. There is no attention: `attention_layers`, `mlp_up`, `mlp_down` and
`layer_input_norms` are empty.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from veil.errors import VeilError
from veil.models.base import AttentionHandles, Batch, NoPositionTable, VeilModel
from veil.models.vit import patchify, unpatchify


@dataclass
class CNNConfig:
    image_size: int = 32
    in_chans: int = 3
    num_classes: int = 10
    patch_size: int = 2  # the jigsaw piece a token-shuffling defense moves
    base_width: int = 32  # channels of the first stage
    stages: int = 2
    blocks: int = 1  # residual blocks per stage
    groups: int = 8  # GroupNorm groups
    dropout: float = 0.0


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, groups: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.norm1 = nn.GroupNorm(min(groups, cout), cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.norm2 = nn.GroupNorm(min(groups, cout), cout)
        self.act = nn.ReLU()
        self.skip: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.skip = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.GroupNorm(min(groups, cout), cout)
            )

    def forward(self, x: Tensor) -> Tensor:
        y = self.act(self.norm1(self.conv1(x)))
        return self.act(self.norm2(self.conv2(y)) + self.skip(x))


class CNN(VeilModel):
    modality = "image"
    absolute_positions = False

    def __init__(self, cfg: CNNConfig) -> None:
        super().__init__()
        if cfg.image_size % cfg.patch_size:
            raise VeilError(f"cnn: patch_size {cfg.patch_size} does not divide image_size {cfg.image_size}")
        if cfg.base_width < 1 or cfg.stages < 1 or cfg.blocks < 1 or cfg.groups < 1:
            raise VeilError("cnn: base_width, stages, blocks and groups must be integers >= 1")
        if cfg.base_width % min(cfg.groups, cfg.base_width):
            raise VeilError(f"cnn: base_width {cfg.base_width} is not divisible by groups {cfg.groups}")
        self.cfg = cfg
        self.pieces = cfg.image_size // cfg.patch_size  # jigsaw pieces per side
        self.stem = nn.Conv2d(cfg.in_chans, cfg.base_width, 3, 1, 1, bias=False)
        self.stem_norm = nn.GroupNorm(min(cfg.groups, cfg.base_width), cfg.base_width)
        layers: list[nn.Module] = []
        cin = cfg.base_width
        for s in range(cfg.stages):
            cout = cfg.base_width * 2**s
            for b in range(cfg.blocks):
                layers.append(BasicBlock(cin, cout, 2 if s > 0 and b == 0 else 1, cfg.groups))
                cin = cout
        self.layers = nn.Sequential(*layers)
        self.drop = nn.Dropout(cfg.dropout)
        self.head = nn.Linear(cin, cfg.num_classes)

    # embedding step: pixel patches as tokens, no positions
    def embed_tokens(self, batch: Batch) -> Tensor:
        return patchify(batch["pixels"], self.cfg.patch_size)

    def position_embeddings(self, tok: Tensor) -> Tensor:
        return tok.new_zeros(1, tok.shape[1], tok.shape[2])

    def movable(self, batch: Batch) -> Tensor:
        B = batch["pixels"].shape[0]
        return torch.ones(B, self.pieces**2, dtype=torch.bool, device=batch["pixels"].device)

    def assemble(self, tok: Tensor, pos: Tensor, batch: Batch) -> Tensor:
        return unpatchify(tok + pos, self.cfg.patch_size, self.cfg.in_chans, self.cfg.image_size)

    def forward_from_embeddings(self, h: Tensor, batch: Batch) -> Tensor:
        x = self.layers(torch.relu(self.stem_norm(self.stem(h))))
        return self.head(self.drop(x.mean(dim=(2, 3))))

    # handles
    def token_embedding(self) -> nn.Module:
        """The stem convolution: the first layer the pixels meet."""
        return self.stem

    def position_table(self) -> nn.Parameter:
        raise NoPositionTable("cnn", "a CNN has no position embeddings")

    def attention_layers(self) -> list[AttentionHandles]:
        return []

    def mlp_up(self) -> list[nn.Module]:
        return []

    def mlp_down(self) -> list[nn.Module]:
        return []

    def layer_input_norms(self) -> list[nn.Module]:
        return []

    def classifier(self) -> nn.Module:
        return self.head

    @property
    def width(self) -> int:
        """The width of a token: one flattened pixel patch."""
        return self.cfg.in_chans * self.cfg.patch_size**2

    @property
    def grid_shape(self) -> tuple[int, int]:
        return (self.pieces, self.pieces)
