"""The original U-Net (Ronneberger, Fischer and Brox, MICCAI 2015), one of Kusumoto et al.'s benchmarks.

Kusumoto et al. (section 5, Table 1) run U-Net on 572x572 inputs at batch 8 and report #V = 60. This module
follows the U-Net paper (section 2, Fig. 1):

* contracting path: 4 levels of two *valid* (unpadded) 3x3 convolutions, each followed by a ReLU, then a
  2x2 max pool with stride 2; channels 64, 128, 256, 512; a bottom level of two 3x3 convolutions with 1024
  channels;
* dropout at the end of the contracting path (U-Net paper, section 3: "Drop-out layers at the end of the
  contracting path"): after the level-4 block and after the bottom block;
* expansive path: 2x2 up-convolution (stride-2 transposed convolution halving the channels), followed by a
  ReLU (``relu_after_upconv``), concatenation with the centre-cropped feature map of the same level, two
  valid 3x3 convolutions with ReLU;
* a final 1x1 convolution to ``num_classes`` (2) output maps.

Input has 1 channel, as in the original (grey-scale microscopy images). With a 572x572 input the output is
388x388. Valid input sizes are ``16 * b + 124`` for a bottom-level size ``b >= 4``; the smallest is 188
(output 4x4); :func:`unet_output_size` computes the output size and rejects invalid inputs.

ReLUs are separate ``nn.ReLU(inplace=True)`` modules, so each is one torch.fx node. The crop is one traced
function call (:func:`center_crop_like`, registered with ``torch.fx.wrap``) so that it is one node rather
than a handful of shape-arithmetic nodes. The model traces with ``torch.fx.symbolic_trace`` to 59 compute
nodes (55 with ``relu_after_upconv=False``), against the paper's #V = 60.
"""

from __future__ import annotations

import torch
import torch.fx
from torch import Tensor, nn

from fxplan.errors import FxplanError

#: Channels of the four contracting levels; the bottom level has twice the last.
UNET_CHANNELS: tuple[int, ...] = (64, 128, 256, 512)


def center_crop_like(x: Tensor, ref: Tensor) -> Tensor:
    """Crop the last two dimensions of ``x`` around their centre to the size of ``ref``'s last two.

    This is U-Net's "copy and crop" (Fig. 1): the skip connection's feature map is larger than the
    up-sampled one because valid convolutions shrink the border. ``ref`` supplies only the target size.
    """
    h, w = x.shape[-2], x.shape[-1]
    th, tw = ref.shape[-2], ref.shape[-1]
    top = (h - th) // 2
    left = (w - tw) // 2
    return x[..., top : top + th, left : left + tw]


# One call_function node in the traced graph instead of shape arithmetic.
torch.fx.wrap("center_crop_like")


def _output_size_or_none(input_size: int, levels: int) -> int | None:
    s = input_size
    for _ in range(levels):
        s -= 4  # two valid 3x3 convolutions
        if s <= 0 or s % 2:
            return None
        s //= 2  # 2x2 max pool
    s -= 4  # bottom level
    for _ in range(levels):
        if s <= 0:
            return None
        s = 2 * s - 4  # up-convolution, then two valid 3x3 convolutions
    return s if s > 0 else None


def unet_output_size(input_size: int, levels: int = len(UNET_CHANNELS)) -> int:
    """Spatial output size of the valid-convolution U-Net for a square ``input_size`` input.

    Every max pool must see an even size and no feature map may vanish. With 4 levels the valid sizes
    are ``16 * b + 124`` for ``b >= 4`` (188, 204, ..., 572, ...). Raises
    :class:`fxplan.errors.FxplanError` naming the smallest valid size and the next valid one otherwise.
    """
    out = _output_size_or_none(input_size, levels)
    if out is not None:
        return out
    smallest = next(s for s in range(1, 1 << 20) if _output_size_or_none(s, levels) is not None)
    above = next(s for s in range(max(input_size, smallest), 1 << 20) if _output_size_or_none(s, levels))
    raise FxplanError(
        f"U-Net input size {input_size} is not valid for unpadded convolutions with {levels} levels; "
        f"use {above} (the next valid size) or any size {smallest} + {2 ** levels}*k"
    )


def _double_conv(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3),
        nn.ReLU(inplace=True),
        nn.Conv2d(cout, cout, 3),
        nn.ReLU(inplace=True),
    )


class UNet(nn.Module):
    """The U-Net of Ronneberger et al. (2015); see the module docstring for the exact layout."""

    def __init__(
        self,
        in_channels: int = 1,
        num_classes: int = 2,
        channels: tuple[int, ...] = UNET_CHANNELS,
        dropout: float = 0.5,
        relu_after_upconv: bool = True,
    ) -> None:
        super().__init__()
        self.down = nn.ModuleList()
        cin = in_channels
        for c in channels:
            self.down.append(_double_conv(cin, c))
            cin = c
        self.pool = nn.MaxPool2d(2, 2)
        self.drop_down = nn.Dropout(dropout)
        self.bottom = _double_conv(cin, 2 * cin)
        self.drop_bottom = nn.Dropout(dropout)
        self.upconv = nn.ModuleList()
        self.up = nn.ModuleList()
        cin = 2 * cin
        for c in reversed(channels):
            layers: list[nn.Module] = [nn.ConvTranspose2d(cin, c, 2, stride=2)]
            if relu_after_upconv:
                layers.append(nn.ReLU(inplace=True))
            self.upconv.append(nn.Sequential(*layers))
            self.up.append(_double_conv(2 * c, c))
            cin = c
        self.head = nn.Conv2d(cin, num_classes, 1)

    def forward(self, x: Tensor) -> Tensor:
        skips = []
        last = len(self.down) - 1
        for i, block in enumerate(self.down):
            x = block(x)
            if i == last:
                x = self.drop_down(x)
            skips.append(x)
            x = self.pool(x)
        x = self.drop_bottom(self.bottom(x))
        for upconv, block, skip in zip(self.upconv, self.up, reversed(skips)):
            x = upconv(x)
            x = block(torch.cat([center_crop_like(skip, x), x], dim=1))
        return self.head(x)
