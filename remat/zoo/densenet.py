"""DenseNet-121 (Huang et al., 2017): every layer of a dense block reads the concatenation of all
the block's earlier outputs, the classic case where activations, not weights, fill memory.

Written here (no torchvision build); shapes as torchvision's ``densenet121`` with
``memory_efficient=False``, i.e. the concatenations are materialized.
"""

from __future__ import annotations

import torch
from torch import nn

from remat.zoo.registry import Workload, ZooModel, register


class DenseLayer(nn.Module):
    def __init__(self, c_in: int, growth: int, bn_size: int) -> None:
        super().__init__()
        self.norm1 = nn.BatchNorm2d(c_in)
        self.conv1 = nn.Conv2d(c_in, bn_size * growth, 1, bias=False)
        self.norm2 = nn.BatchNorm2d(bn_size * growth)
        self.conv2 = nn.Conv2d(bn_size * growth, growth, 3, padding=1, bias=False)

    def forward(self, features: list[torch.Tensor]) -> torch.Tensor:
        x = torch.cat(features, 1)
        x = self.conv1(nn.functional.relu(self.norm1(x)))
        return self.conv2(nn.functional.relu(self.norm2(x)))


class DenseBlock(nn.Module):
    def __init__(self, layers: int, c_in: int, growth: int, bn_size: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(DenseLayer(c_in + i * growth, growth, bn_size) for i in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = [x]
        for layer in self.layers:
            features.append(layer(features))
        return torch.cat(features, 1)


class Transition(nn.Sequential):
    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__(
            nn.BatchNorm2d(c_in), nn.ReLU(), nn.Conv2d(c_in, c_out, 1, bias=False), nn.AvgPool2d(2, stride=2)
        )


class DenseNet(nn.Module):
    def __init__(
        self,
        blocks: tuple[int, ...] = (6, 12, 24, 16),
        growth: int = 32,
        init: int = 64,
        bn_size: int = 4,
        classes: int = 1000,
    ) -> None:
        super().__init__()
        stages: list[nn.Module] = [
            nn.Conv2d(3, init, 7, stride=2, padding=3, bias=False),
            nn.BatchNorm2d(init),
            nn.ReLU(),
            nn.MaxPool2d(3, stride=2, padding=1),
        ]
        c = init
        for i, n in enumerate(blocks):
            stages.append(DenseBlock(n, c, growth, bn_size))
            c += n * growth
            if i < len(blocks) - 1:
                stages.append(Transition(c, c // 2))
                c //= 2
        stages += [nn.BatchNorm2d(c), nn.ReLU()]
        self.features = nn.Sequential(*stages)
        self.head = nn.Linear(c, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(self.features(x), 1), 1))


def _make(batch: int, image: int, tiny: bool) -> Workload:
    classes = 10 if tiny else 1000
    model = DenseNet((2, 2, 2, 2), growth=4, init=8, classes=classes) if tiny else DenseNet()
    x = torch.randn(batch, 3, image, image)
    y = torch.randint(0, classes, (batch,))
    return Workload(model, (x,), lambda logits: nn.functional.cross_entropy(logits, y))


register(
    ZooModel(
        "densenet121", "DenseNet-121, ImageNet classifier", "image", 64, 224, _make, multiple=32, tiny_size=32
    )
)
