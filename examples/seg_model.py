"""A compact DeepLabV3+ for the segmentation example (no torchvision).

The parts of DeepLabV3+ (Chen et al., 2018), scaled down to train on a CPU in seconds:

* an encoder whose last stage keeps output stride 8 by dilating its convolutions instead of
  striding further (atrous convolution), and hands its stride-4 features to the decoder;
* ASPP: a 1x1 branch, three 3x3 atrous branches and an image-pooling branch, side by side;
* a decoder that upsamples the ASPP output, concatenates the stride-4 features (the skip
  connection), refines with two 3x3 convolutions and upsamples logits to the input size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ConvBNReLU(nn.Sequential):
    """Conv (no bias) -> BatchNorm -> ReLU; ``padding = dilation`` keeps 3x3 maps' size."""

    def __init__(
        self, in_ch: int, out_ch: int, kernel_size: int = 3, *, stride: int = 1, dilation: int = 1
    ) -> None:
        padding = dilation * (kernel_size - 1) // 2
        super().__init__(
            nn.Conv2d(in_ch, out_ch, kernel_size, stride, padding, dilation, bias=False),
            nn.BatchNorm2d(out_ch),
            nn.ReLU(inplace=True),
        )


class AtrousBlock(nn.Module):
    """A residual block of two dilated 3x3 convolutions: a wider view at the same stride."""

    def __init__(self, channels: int, dilation: int) -> None:
        super().__init__()
        self.conv1 = ConvBNReLU(channels, channels, dilation=dilation)
        self.conv2 = nn.Conv2d(
            channels, channels, 3, padding=dilation, dilation=dilation, bias=False
        )
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.bn2(self.conv2(self.conv1(x))))


class Encoder(nn.Module):
    """Strided convolutions to stride 8, then atrous blocks at stride 8.

    Returns ``(low, high)``: stride-4 features for the skip and stride-8 features for ASPP.
    """

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.low_channels = width
        self.high_channels = 2 * width
        self.stem = nn.Sequential(
            ConvBNReLU(3, width // 2, stride=2),  # stride 2
            ConvBNReLU(width // 2, width, stride=2),  # stride 4
            ConvBNReLU(width, width),
        )
        self.down = ConvBNReLU(width, 2 * width, stride=2)  # stride 8, the output stride
        self.atrous = nn.Sequential(AtrousBlock(2 * width, 2), AtrousBlock(2 * width, 4))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        low = self.stem(x)
        return low, self.atrous(self.down(low))


class ASPP(nn.Module):
    """Atrous spatial pyramid pooling: parallel views at several rates, fused by a 1x1 conv.

    The image-pooling branch has no BatchNorm: its map is 1x1, so a one-sample batch (which a
    short last batch can be) would leave BatchNorm a single value per channel.
    """

    def __init__(self, in_ch: int, out_ch: int, rates: tuple[int, ...] = (2, 4, 6)) -> None:
        super().__init__()
        self.branches = nn.ModuleList(
            [ConvBNReLU(in_ch, out_ch, 1)] + [ConvBNReLU(in_ch, out_ch, dilation=r) for r in rates]
        )
        self.pool = nn.Sequential(
            nn.AdaptiveAvgPool2d(1), nn.Conv2d(in_ch, out_ch, 1), nn.ReLU(inplace=True)
        )
        self.project = nn.Sequential(
            ConvBNReLU(out_ch * (len(rates) + 2), out_ch, 1), nn.Dropout(0.1)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pooled = self.pool(x).expand(-1, -1, x.shape[2], x.shape[3])
        return self.project(torch.cat([b(x) for b in self.branches] + [pooled], dim=1))


class Decoder(nn.Module):
    """Upsample the ASPP output to the skip's size, concatenate, refine, classify."""

    def __init__(self, aspp_ch: int, low_ch: int, num_classes: int, skip_ch: int = 16) -> None:
        super().__init__()
        self.skip = ConvBNReLU(low_ch, skip_ch, 1)  # few channels, so ASPP's features dominate
        self.refine = nn.Sequential(
            ConvBNReLU(aspp_ch + skip_ch, aspp_ch), ConvBNReLU(aspp_ch, aspp_ch)
        )
        self.classifier = nn.Conv2d(aspp_ch, num_classes, 1)

    def forward(self, high: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
        high = F.interpolate(high, size=low.shape[2:], mode="bilinear", align_corners=False)
        return self.classifier(self.refine(torch.cat([high, self.skip(low)], dim=1)))


class DeepLabV3Plus(nn.Module):
    """Encoder (atrous, output stride 8) -> ASPP -> decoder with a stride-4 skip.

    Args:
        num_classes: channels of the output logits.
        width: channels of the stride-4 features (stride 8 has twice as many).

    ``forward`` maps ``(N, 3, H, W)`` images to ``(N, num_classes, H, W)`` logits.
    """

    def __init__(self, num_classes: int, width: int = 32) -> None:
        super().__init__()
        self.encoder = Encoder(width)
        self.aspp = ASPP(self.encoder.high_channels, self.encoder.high_channels)
        self.decoder = Decoder(self.encoder.high_channels, self.encoder.low_channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        low, high = self.encoder(x)
        logits = self.decoder(self.aspp(high), low)
        return F.interpolate(logits, size=x.shape[2:], mode="bilinear", align_corners=False)


def build_model(num_classes: int, width: int = 32) -> DeepLabV3Plus:
    """The example's model; ``width=32`` gives about 0.3 M parameters."""
    return DeepLabV3Plus(num_classes, width)
