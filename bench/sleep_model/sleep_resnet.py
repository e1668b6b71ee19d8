"""A model of the GPU regime on a CPU: ResNet-18's parameters, a sleep for its compute, spread
over its layers as a GPU spends it.

A user's own model and dataset for the app (`--model sleep_resnet:resnet18_65ms
--dataset sleep_resnet:images`, with this directory as the topology's `code`),
used by `python -m bench gpu` and `python -m bench constants`. The model holds the
real torchvision resnet18's parameters and buffers (10 classes: 11,181,642
parameters and 9,600 float buffer values, 44.8 MB), so every push and pull moves
what ResNet-18's would. Its forward and backward are sleeps, C seconds in all,
which leave the CPU free as a GPU's compute does: a third of C in the forward and
two thirds in the backward (the backward of a layer ~2x its forward), each split
over the 41 layers that hold parameters (20 convolutions, 20 batch norms, the
linear head) in proportion to their forward FLOPs at the input's size (LAYER_FLOPS:
counted, not measured on a GPU). The forward runs them first to last, the backward
last to first, one autograd node per layer: autograd adds each layer's gradient
into its parameters' `.grad` as soon as that layer's backward sleep ends, so
hooks on the parameters (`register_post_accumulate_grad_hook`, DDP's hooks on
the grad accumulators) fire during the backward, spread over it, last layers
first, as on a GPU. The gradients are real tensors that autograd hands to every
parameter's `.grad`: a small random block per layer shape, made once and
broadcast over the layer's output channels, so that putting a gradient in host
memory costs the host what a GPU's copy into host memory costs it, the bytes
written, and no 45 MB read from host memory that a GPU would read from its own.

Each pass paces its sleeps against a clock started at its first layer (a layer
sleeps until the sum of the shares so far has passed), so the many short sleeps
add up to the pass's share of C, not to C plus each sleep's overshoot. What each
layer asked for is kept in `model.last_step` (a `Step`): its `forward` and
`backward` lists of (layer, seconds) in the order the layers ran. The factory's
name gives C in milliseconds: `resnet18_<C>ms` (any whole number; 0 sleeps not at all).

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
_GRADS: dict[tuple[torch.Size, ...], list[torch.Tensor]] = {}  # by a layer's parameter shapes, never pickled
_SHARES: dict[tuple[int, ...], list[float]] = {}  # by (classes, input shape): each layer's share of the FLOPs
FORWARD_FRACTION = 1 / 3  # of C in the forward; the backward takes the rest (2x the forward)
LAYERS = (nn.Conv2d, nn.BatchNorm2d, nn.Linear)  # the layers that hold ResNet-18's parameters
POOL = 64  # distinct images the dataset cycles through
TRAIN_SAMPLES = 1_000_000  # the training split's length: more than any bench run takes
HELD_OUT = 20  # one batch of 20: the PS's evaluation stays short


def layer_flops(module: nn.Module, output: torch.Size) -> int:
    """Forward FLOPs of one layer for one sample, from its output's shape (batch first): a
    convolution 2 per multiply-add over its kernel and input channels, the linear layer the
    same over its inputs, a batch norm 2 a value (its scale and shift)."""
    values = output[1:].numel()
    if isinstance(module, nn.Conv2d):
        kh, kw = module.kernel_size
        return values * (2 * kh * kw * module.in_channels // module.groups + (module.bias is not None))
    if isinstance(module, nn.Linear):
        return values * (2 * module.in_features + (module.bias is not None))
    return 2 * values


def flop_shares(num_classes: int, input_shape: tuple[int, ...]) -> list[float]:
    """Each layer's share (LAYERS, in forward order) of resnet18's forward FLOPs for one input
    of `input_shape` (channels, height, width); the shapes come from a forward on the meta
    device (no compute)."""
    key = (num_classes, *input_shape)
    if key not in _SHARES:
        from torchvision.models import resnet18

        with torch.device("meta"):
            net = resnet18(num_classes=num_classes).eval()
        flops: dict[str, int] = {}
        for name, m in _layers(net):
            m.register_forward_hook(lambda mod, _i, out, name=name: flops.update({name: layer_flops(mod, out.shape)}))
        net(torch.empty((1, *input_shape), device="meta"))
        total = sum(flops.values())
        _SHARES[key] = [flops[name] / total for name, _ in _layers(net)]
    return _SHARES[key]


def _layers(net: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(name, m) for name, m in net.named_modules() if isinstance(m, LAYERS)]


def _grads_for(shapes: tuple[torch.Size, ...]) -> list[torch.Tensor]:
    """Small random gradients, one per parameter shape, made once per process: a random block
    of one output channel's values broadcast over all of them (no storage of their own beyond
    that block)."""
    if shapes not in _GRADS:
        g = torch.Generator().manual_seed(0)
        _GRADS[shapes] = [torch.randn((1, *shape[1:]), generator=g).mul_(1e-4).expand(shape) for shape in shapes]
    return _GRADS[shapes]


class Pacer:
    """Sleeps that add up: each `sleep(s)` ends at the first call's time plus every `s` so far."""

    def __init__(self) -> None:
        self.deadline: float | None = None

    def sleep(self, seconds: float) -> None:
        now = time.monotonic()
        self.deadline = (now if self.deadline is None else self.deadline) + seconds
        if self.deadline > now:
            time.sleep(self.deadline - now)


class Step:
    """One forward and its backward: the seconds each layer asks for, and the (layer, seconds)
    asked, in the order the layers ran (`forward`, then `backward`)."""

    def __init__(self, names: list[str], forward_s: list[float], backward_s: list[float]) -> None:
        self.names, self.forward_s, self.backward_s = names, forward_s, backward_s
        self.forward: list[tuple[str, float]] = []
        self.backward: list[tuple[str, float]] = []
        self._paced = (Pacer(), Pacer())

    def run(self, index: int, backward: bool) -> None:
        """Layer `index`'s share of the forward or the backward."""
        seconds = (self.backward_s if backward else self.forward_s)[index]
        (self.backward if backward else self.forward).append((self.names[index], seconds))
        self._paced[backward].sleep(seconds)

    def asked(self) -> float:
        """Seconds asked so far, forward and backward."""
        return sum(s for _, s in self.forward) + sum(s for _, s in self.backward)


class LayerSleep(torch.autograd.Function):
    """One layer: forward, its forward share (the token passed on); backward, its backward
    share and a gradient for each of the layer's parameters."""

    @staticmethod
    def forward(ctx, token: torch.Tensor, step: Step, index: int, *params: torch.Tensor) -> torch.Tensor:
        ctx.step, ctx.index, ctx.shapes = step, index, tuple(p.shape for p in params)
        step.run(index, backward=False)
        return token.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.step.run(ctx.index, backward=True)
        return (grad, None, None, *_grads_for(ctx.shapes))


class SleepResNet18(nn.Module):
    """torchvision's resnet18 (its parameters and buffers, unused by the forward) and a
    forward + backward that take `seconds` of wall time, layer by layer, and no CPU."""

    def __init__(self, seconds: float, num_classes: int = 10) -> None:
        super().__init__()
        from torchvision.models import resnet18

        self.net = resnet18(num_classes=num_classes)
        self.seconds, self.num_classes = seconds, num_classes
        layers = _layers(self.net)
        self.layer_names = [name for name, _ in layers]
        self._params = [list(m.parameters(recurse=False)) for _, m in layers]
        if [id(p) for ps in self._params for p in ps] != [id(p) for p in self.parameters()]:
            raise RuntimeError("the layers do not hold every parameter of resnet18 in order")
        self.last_step: Step | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shares = flop_shares(self.num_classes, tuple(x.shape[1:]))
        forward_s = [self.seconds * FORWARD_FRACTION * s for s in shares]
        backward_s = [self.seconds * (1 - FORWARD_FRACTION) * s for s in shares]
        step = self.last_step = Step(self.layer_names, forward_s, backward_s)
        token = x.new_zeros(x.shape[0], self.num_classes)
        for index, params in enumerate(self._params):
            token = LayerSleep.apply(token, step, index, *params)
        return token


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
