"""The models the bench runs, each with its input shape and batch size.

`cnn` is the app's own built-in model (the cpu-smoke run: 8x8 digits);
`mnist-cnn` is pytorch/examples' MNIST `Net` (4.8 MB, the size the RPC
tutorials train); `resnet18` is ResNet-18 itself (11.7M parameters, 46.8 MB,
the model of configs/default.yaml), written here so the bench needs no torchvision, fed
3x32x32 inputs so its compute stays short next to its bytes on a CPU;
`resnet18-10` is the headline table's ResNet-18: 10 classes, batch 20 of 3x32x32.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


class MnistNet(nn.Module):
    """pytorch/examples mnist/main.py `Net`: 1,199,882 parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
        x = self.dropout1(x).flatten(1)
        x = self.dropout2(F.relu(self.fc1(x)))
        return self.fc2(x)


class BasicBlock(nn.Module):
    def __init__(self, inp: int, out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inp, out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out)
        self.conv2 = nn.Conv2d(out, out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out)
        self.downsample = (
            nn.Sequential(nn.Conv2d(inp, out, 1, stride, bias=False), nn.BatchNorm2d(out))
            if stride != 1 or inp != out
            else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.downsample(x))


class ResNet18(nn.Module):
    """torchvision's resnet18 layer for layer: 11,689,512 parameters with 1000 classes."""

    def __init__(self, num_classes: int = 1000) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        widths = [(64, 64, 1), (64, 128, 2), (128, 256, 2), (256, 512, 2)]
        self.layers = nn.Sequential(*[nn.Sequential(BasicBlock(i, o, s), BasicBlock(o, o, 1)) for i, o, s in widths])
        self.fc = nn.Linear(512, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 3, 2, 1)
        x = F.adaptive_avg_pool2d(self.layers(x), 1).flatten(1)
        return self.fc(x)


def _app_cnn() -> nn.Module:
    from app.training import models  # the app's own model, built as the app builds it

    return models.build("cnn", 1, 10, seed=0)


@dataclass(frozen=True)
class Spec:
    """A model of the bench: how to build it and what one batch looks like."""

    name: str
    build: Callable[[], nn.Module]
    input_shape: tuple[int, ...]
    num_classes: int
    batch_size: int = 32

    def batch(self, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """A fixed synthetic batch: the bench times compute and bytes, not data loading."""
        g = torch.Generator().manual_seed(seed)
        x = torch.randn((self.batch_size, *self.input_shape), generator=g)
        return x, torch.randint(0, self.num_classes, (self.batch_size,), generator=g)

    def model(self, seed: int = 0) -> nn.Module:
        torch.manual_seed(seed)
        return self.build()


SPECS = {
    "cnn": Spec("cnn", _app_cnn, (1, 8, 8), 10),
    "mnist-cnn": Spec("mnist-cnn", MnistNet, (1, 28, 28), 10),
    "resnet18": Spec("resnet18", ResNet18, (3, 32, 32), 1000),
    "resnet18-10": Spec("resnet18-10", lambda: ResNet18(10), (3, 32, 32), 10, batch_size=20),
}
FULL_MODELS = ("cnn", "mnist-cnn", "resnet18")  # `python -m bench full`
HEADLINE_MODELS = ("resnet18-10", "mnist-cnn")  # `python -m bench`


def state_floats(model: nn.Module) -> tuple[int, int]:
    """(parameter count, floating-point buffer count) of a model."""
    params = sum(p.numel() for p in model.parameters())
    buffers = sum(b.numel() for b in model.buffers() if b.is_floating_point())
    return params, buffers
