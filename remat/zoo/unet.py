"""U-Net (Ronneberger et al., 2015): an encoder-decoder whose skip connections keep the
full-resolution encoder activations alive until the decoder's end, a long-lived-tensor pattern
that chain checkpointing handles badly.

The classic layout (4 down, 4 up, 64 channels at the top, two 3×3 conv + BN + ReLU per level),
with padded convolutions so the output has the input's size; per-pixel classification loss.
"""

from __future__ import annotations

import torch
from torch import nn

from remat.zoo.registry import Workload, ZooModel, register


class DoubleConv(nn.Sequential):
    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__(
            nn.Conv2d(c_in, c_out, 3, padding=1, bias=False),
            nn.BatchNorm2d(c_out),
            nn.ReLU(inplace=True),
            nn.Conv2d(c_out, c_out, 3, padding=1, bias=False),
            nn.BatchNorm2d(c_out),
            nn.ReLU(inplace=True),
        )


class UNet(nn.Module):
    def __init__(self, base: int = 64, depth: int = 4, c_in: int = 3, classes: int = 2) -> None:
        super().__init__()
        widths = [base * 2**i for i in range(depth + 1)]
        self.inc = DoubleConv(c_in, widths[0])
        self.down = nn.ModuleList(DoubleConv(widths[i], widths[i + 1]) for i in range(depth))
        self.up = nn.ModuleList(
            nn.ConvTranspose2d(widths[i + 1], widths[i], 2, stride=2) for i in reversed(range(depth))
        )
        self.dec = nn.ModuleList(DoubleConv(2 * widths[i], widths[i]) for i in reversed(range(depth)))
        self.head = nn.Conv2d(widths[0], classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = [self.inc(x)]
        for down in self.down:
            skips.append(down(nn.functional.max_pool2d(skips[-1], 2)))
        h = skips.pop()
        for up, dec in zip(self.up, self.dec, strict=True):
            h = dec(torch.cat([skips.pop(), up(h)], 1))
        return self.head(h)


def _make(batch: int, image: int, tiny: bool) -> Workload:
    model = UNet(base=4) if tiny else UNet()
    x = torch.randn(batch, 3, image, image)
    y = torch.randint(0, 2, (batch, image, image))
    return Workload(model, (x,), lambda logits: nn.functional.cross_entropy(logits, y))


register(ZooModel("unet", "U-Net, 2-class segmentation", "image", 8, 256, _make, multiple=16, tiny_size=32))
