"""The models and synthetic data every benchmark trains, defined once.

- ``cnn``: two conv layers and two linear layers on 1x28x28 inputs (about 0.1 M parameters):
  small enough that a step on a CPU core takes milliseconds, so a framework's own per-step
  work shows.
- ``resnet``: a ResNet-18 for 3x32x32 inputs (CIFAR layout: a 3x3 stem, no max-pool; four
  stages of two basic blocks, 64-512 channels; 11.2 M parameters), written in plain torch so
  the benchmarks need no torchvision. On a GPU this is the model whose step is the GPU's work.

Both take 10 classes. ``make_data`` draws inputs of the shape the model reads.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

MODELS = ("cnn", "resnet")


def make_cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 7 * 7, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with batch norm and a shortcut (a 1x1 projection when the shape
    changes), as in ResNet-18 and -34."""

    def __init__(self, inputs: int, outputs: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inputs, outputs, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(outputs)
        self.conv2 = nn.Conv2d(outputs, outputs, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(outputs)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or inputs != outputs:
            self.shortcut = nn.Sequential(
                nn.Conv2d(inputs, outputs, 1, stride=stride, bias=False), nn.BatchNorm2d(outputs)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


def make_resnet(classes: int = 10) -> nn.Module:
    """ResNet-18 for 32x32 images: 3x3 stem, [2, 2, 2, 2] basic blocks, global pooling."""
    torch.manual_seed(0)
    layers: list[nn.Module] = [
        nn.Conv2d(3, 64, 3, padding=1, bias=False),
        nn.BatchNorm2d(64),
        nn.ReLU(),
    ]
    inputs = 64
    for outputs, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [BasicBlock(inputs, outputs, stride), BasicBlock(outputs, outputs, 1)]
        inputs = outputs
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, classes)]
    return nn.Sequential(*layers)


def make_model(name: str = "cnn") -> nn.Module:
    """A fresh model (seeded: every contender starts from the same weights)."""
    builders = {"cnn": make_cnn, "resnet": make_resnet}
    if name not in builders:
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
    return builders[name]()


def input_shape(name: str = "cnn") -> tuple[int, int, int]:
    return (3, 32, 32) if name == "resnet" else (1, 28, 28)


def make_data(n: int, name: str = "cnn") -> TensorDataset:
    """``n`` random inputs of the model's shape and random labels of its 10 classes."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(n, *input_shape(name), generator=generator)
    return TensorDataset(x, torch.randint(0, 10, (n,), generator=generator))
