"""ResNet-50 (He et al., 2016): bottleneck residual blocks, batch norm, 224² ImageNet input.

Written here because there is no torchvision build to depend on; the layer shapes are those of
torchvision's ``resnet50`` (stride on the 3×3 convolution, "ResNet v1.5").
"""

from __future__ import annotations

import torch
from torch import nn

from remat.zoo.registry import Workload, ZooModel, register


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, c_in: int, width: int, stride: int) -> None:
        super().__init__()
        c_out = width * self.expansion
        self.conv1 = nn.Conv2d(c_in, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, c_out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(c_out)
        self.relu = nn.ReLU(inplace=True)
        self.downsample: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.downsample = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + self.downsample(x))


class ResNet(nn.Module):
    def __init__(self, blocks: tuple[int, ...] = (3, 4, 6, 3), width: int = 64, classes: int = 1000) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(3, stride=2, padding=1),
        )
        layers: list[nn.Module] = []
        c_in = width
        for i, n in enumerate(blocks):
            w = width * 2**i
            for j in range(n):
                layers.append(Bottleneck(c_in, w, stride=2 if i > 0 and j == 0 else 1))
                c_in = w * Bottleneck.expansion
        self.layers = nn.Sequential(*layers)
        self.head = nn.Linear(c_in, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(self.layers(self.stem(x)), 1), 1))


def _make(batch: int, image: int, tiny: bool) -> Workload:
    classes = 10 if tiny else 1000
    model = ResNet((1, 1, 1, 1), 8, classes) if tiny else ResNet()
    x = torch.randn(batch, 3, image, image)
    y = torch.randint(0, classes, (batch,))
    return Workload(model, (x,), lambda logits: nn.functional.cross_entropy(logits, y))


register(
    ZooModel("resnet50", "ResNet-50, ImageNet classifier", "image", 64, 224, _make, multiple=32, tiny_size=32)
)
