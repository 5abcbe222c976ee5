"""PSPNet (Zhao et al., CVPR 2017) with a dilated ResNet-101 backbone, one of Kusumoto et al.'s benchmarks.

Kusumoto et al. (section 5, Table 1) run PSPNet on 713x713 inputs at batch 2 and report #V = 385. The
network here follows the PSPNet paper (section 3.2-3.3):

* backbone: ResNet-101 built by torchvision (``weights=None``) with ``replace_stride_with_dilation=
  [False, True, True]``, so stages 3 and 4 keep stride 8 and use dilation 2 and 4. The stem is the
  "deep stem" of PSPNet's released ResNet (three 3x3 convolutions, 64/64/128 channels, each with
  BatchNorm and ReLU, then the 3x3 max pool) instead of torchvision's single 7x7 convolution;
  ``deep_stem=False`` keeps torchvision's stem;
* pyramid pooling module with bins 1, 2, 3, 6: for each bin an adaptive average pool, a 1x1 convolution
  to 2048/4 = 512 channels, BatchNorm, ReLU and a bilinear upsample back to the feature size, all
  concatenated with the backbone features (4096 channels);
* main head: 3x3 convolution to 512 channels, BatchNorm, ReLU, dropout 0.1, 1x1 convolution to the
  classes, bilinear upsample to the input size;
* auxiliary head on the stage-3 (``layer3``) output, as in the paper's deep supervision (section 3.4):
  3x3 convolution to 256 channels, BatchNorm, ReLU, dropout 0.1, 1x1 convolution, upsample.

In train mode ``forward`` returns the tuple ``(logits, aux_logits)``, both ``(N, classes, H, W)`` at the
input size; in eval mode only ``logits``. (torch.fx records the mode at trace time, as for torchvision's
GoogLeNet.) Upsampling is one traced call of :func:`resize_like` per use (registered with
``torch.fx.wrap``) rather than shape arithmetic. The model traces to 381 compute nodes (375 with
``deep_stem=False``) against the paper's #V = 385.
"""

from __future__ import annotations

import torch
import torch.fx
import torch.nn.functional as F
import torchvision
from torch import Tensor, nn

#: Bin sizes of the pyramid pooling module (PSPNet paper, section 3.3).
PSP_BINS: tuple[int, ...] = (1, 2, 3, 6)


def resize_like(x: Tensor, ref: Tensor) -> Tensor:
    """Bilinearly resize the last two dimensions of ``x`` to those of ``ref`` (align_corners=False)."""
    return F.interpolate(x, size=ref.shape[-2:], mode="bilinear", align_corners=False)


# One call_function node in the traced graph instead of shape arithmetic.
torch.fx.wrap("resize_like")


def _conv_bn_relu(cin: int, cout: int, kernel: int, stride: int = 1) -> list[nn.Module]:
    return [
        nn.Conv2d(cin, cout, kernel, stride=stride, padding=kernel // 2, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU(inplace=True),
    ]


class PyramidPooling(nn.Module):
    """Pyramid pooling module (PSPNet paper, section 3.3, Fig. 3(c))."""

    def __init__(self, in_channels: int, bins: tuple[int, ...] = PSP_BINS) -> None:
        super().__init__()
        out = in_channels // len(bins)
        self.stages = nn.ModuleList(
            nn.Sequential(nn.AdaptiveAvgPool2d(b), *_conv_bn_relu(in_channels, out, 1)) for b in bins
        )
        self.out_channels = in_channels + out * len(bins)

    def forward(self, x: Tensor) -> Tensor:
        return torch.cat([x] + [resize_like(stage(x), x) for stage in self.stages], dim=1)


def _head(cin: int, mid: int, num_classes: int, dropout: float) -> nn.Sequential:
    return nn.Sequential(*_conv_bn_relu(cin, mid, 3), nn.Dropout(dropout), nn.Conv2d(mid, num_classes, 1))


class PSPNet(nn.Module):
    """Pyramid Scene Parsing Network; see the module docstring for the exact layout."""

    def __init__(self, num_classes: int = 21, deep_stem: bool = True, dropout: float = 0.1) -> None:
        super().__init__()
        resnet = torchvision.models.resnet101(weights=None, replace_stride_with_dilation=[False, True, True])
        if deep_stem:
            stem = [*_conv_bn_relu(3, 64, 3, 2), *_conv_bn_relu(64, 64, 3), *_conv_bn_relu(64, 128, 3)]
            # The first bottleneck now receives 128 channels instead of 64.
            first = resnet.layer1[0]
            first.conv1 = nn.Conv2d(128, first.conv1.out_channels, 1, bias=False)
            first.downsample[0] = nn.Conv2d(128, first.downsample[0].out_channels, 1, bias=False)
        else:
            stem = [resnet.conv1, resnet.bn1, resnet.relu]
        self.stem = nn.Sequential(*stem, resnet.maxpool)
        self.layer1, self.layer2 = resnet.layer1, resnet.layer2
        self.layer3, self.layer4 = resnet.layer3, resnet.layer4
        self.ppm = PyramidPooling(2048)
        self.head = _head(self.ppm.out_channels, 512, num_classes, dropout)
        self.aux_head = _head(1024, 256, num_classes, dropout)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: Tensor) -> Tensor | tuple[Tensor, Tensor]:
        f = self.layer2(self.layer1(self.stem(x)))
        f3 = self.layer3(f)
        out = resize_like(self.head(self.ppm(self.layer4(f3))), x)
        if self.training:
            return out, resize_like(self.aux_head(f3), x)
        return out
