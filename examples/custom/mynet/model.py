"""The example's network: `train.model: mynet.model:build`."""

from __future__ import annotations

import torch
from torch import nn


class TinyNet(nn.Module):
    """Two small conv layers and one linear layer; any image size (pooled to 2x2)."""

    def __init__(self, num_classes: int, channels: int) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(channels, 16, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(2),
        )
        self.head = nn.Linear(32 * 2 * 2, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


def build(num_classes: int, channels: int) -> nn.Module:
    """The model factory ps-compose calls: model(num_classes, channels) -> nn.Module."""
    return TinyNet(num_classes, channels)
