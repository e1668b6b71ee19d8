"""A model of the GPU regime on a CPU: ResNet-18's parameters, a sleep for its compute.

A user's own model and dataset for the app (`--model sleep_resnet:resnet18_65ms
--dataset sleep_resnet:images`, with this directory as the topology's `code`),
used by `python -m bench gpu`. The model holds the real torchvision resnet18's
parameters and buffers (10 classes: 11,181,642 parameters and 9,600 float
buffer values, 44.8 MB), so every push and pull moves what ResNet-18's would;
its forward and backward are a sleep of C seconds in all (a third in the
forward, two thirds in the backward: a GPU's split), which leaves the CPU free
as a GPU's compute does. The backward still writes a real gradient for every
parameter: it returns gradients allocated once, which autograd adds into each
parameter's `.grad` as a real backward's would. The factory's name gives C in
milliseconds: `resnet18_<C>ms` (any whole number).

Standard library, torch and torchvision only: the same file runs as local
processes, in containers (mounted at /code) and under the published PyTorch
example (bench/official.py).
"""

from __future__ import annotations

import re
import time

import torch
from torch import nn
from torch.utils.data import Dataset

_FACTORY = re.compile(r"^resnet18_(\d+)ms$")
_GRADS: dict[tuple[tuple[int, ...], ...], list[torch.Tensor]] = {}  # by parameter shapes, never pickled
POOL = 64  # distinct images the dataset cycles through
TRAIN_SAMPLES = 1_000_000  # the training split's length: more than any bench run takes
HELD_OUT = 20  # one batch of 20: the PS's evaluation stays short


def _grads_for(params: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    """Small random gradients, one per parameter, allocated once per process."""
    key = tuple(tuple(p.shape) for p in params)
    if key not in _GRADS:
        g = torch.Generator().manual_seed(0)
        _GRADS[key] = [torch.randn(p.shape, generator=g).mul_(1e-4) for p in params]
    return _GRADS[key]


class SleepCompute(torch.autograd.Function):
    """Forward: sleep a third of C and answer zero logits; backward: sleep two thirds of
    C and return a gradient per parameter."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, seconds: float, num_classes: int, *params: torch.Tensor) -> torch.Tensor:
        ctx.seconds, ctx.params = seconds, params
        time.sleep(seconds / 3)
        return x.new_zeros(x.shape[0], num_classes)

    @staticmethod
    def backward(ctx, _grad_out: torch.Tensor):
        time.sleep(2 * ctx.seconds / 3)
        return (None, None, None, *_grads_for(ctx.params))


class SleepResNet18(nn.Module):
    """torchvision's resnet18 (its parameters and buffers, unused by the forward) and a
    forward + backward that take `seconds` of wall time and no CPU."""

    def __init__(self, seconds: float, num_classes: int = 10) -> None:
        super().__init__()
        from torchvision.models import resnet18

        self.net = resnet18(num_classes=num_classes)
        self.seconds, self.num_classes = seconds, num_classes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return SleepCompute.apply(x, self.seconds, self.num_classes, *self.parameters())


def __getattr__(name: str):
    """`resnet18_<C>ms`: the app's model factory `(num_classes, channels) -> nn.Module`."""
    match = _FACTORY.match(name)
    if match is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    seconds = int(match.group(1)) / 1000

    def factory(num_classes: int = 10, channels: int = 3) -> nn.Module:
        return SleepResNet18(seconds, num_classes)

    factory.__name__ = name
    return factory


class Images(Dataset):
    """`length` samples cycling through POOL fixed random 3x32x32 images, 10 classes."""

    def __init__(self, length: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(POOL, 3, 32, 32, generator=g)
        self.y = torch.randint(0, 10, (POOL,), generator=g)
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.x[i % POOL], int(self.y[i % POOL])


def images(root: str, train: bool, seed: int) -> tuple[Dataset, int, int]:
    """The app's dataset factory: (Dataset, channels 3, 10 classes); nothing is read."""
    return Images(TRAIN_SAMPLES if train else HELD_OUT, seed), 3, 10
