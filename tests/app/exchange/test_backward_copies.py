"""A GPU worker's partitions (app.exchange.layout): its gradient copied into the push slot as its
backward finishes each one (app.exchange.backward_copies), and its forward's waits for the
reply's (app.exchange.ordered_pull). The copies themselves need a GPU
(tests/app/worker/test_gpu_step.py); here a recorder stands in for app.exchange.slot_copies."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from app.exchange.backward_copies import BackwardCopies
from app.exchange.layout import cut, owners
from app.training.flat import FlatModel


def test_partitions_are_cut_at_parameter_boundaries_and_the_last_holds_the_buffers():
    assert cut([5, 5, 20, 3], 40, 8) == [(0, 10), (10, 30), (30, 40)]  # 3 params + 7 buffer values last
    assert owners([5, 5, 20, 3], [(0, 10), (10, 30), (30, 40)]) == [0, 0, 1, 2]
    assert cut([100], 100, 8) == [(0, 100)]  # a parameter larger than the target is a partition of its own
    assert cut([5, 5], 12, 100) == [(0, 12)]  # a small model: one partition, nothing goes ahead
    assert cut([4, 4], 8, 4) == [(0, 4), (4, 8)]
    with pytest.raises(ValueError):
        cut([5], 4, 8)


class Deep(nn.Module):
    """Four linear layers and a BatchNorm: four parameter tensors of 64 x 64, and buffers."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(*[nn.Linear(64, 64, bias=False) for _ in range(4)], nn.BatchNorm1d(64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class Recorder:
    """What BackwardCopies asks of app.exchange.slot_copies.SlotCopies, recorded: which piece was
    copied into which slot, and whether it was during the backward or at the push."""

    def __init__(self, pieces: list[tuple[int, int]]) -> None:
        self.pieces = pieces
        self.flags = torch.ones(2, len(pieces), dtype=torch.bool)
        self.copies: list[tuple[int, int]] = []  # (slot, piece), in order
        self.landed_after = -1  # how many copies had started when the push asked for the event

    def copy(self, message: torch.Tensor, slot: int, piece: int) -> None:
        self.copies.append((slot, piece))

    def landed(self) -> str:
        self.landed_after = len(self.copies)
        return "landed"


def _copies(model: nn.Module, target: int) -> tuple[BackwardCopies, Recorder]:
    params = list(model.parameters())
    flat = FlatModel(model)
    recorder = Recorder(cut([p.numel() for p in params], flat.size, target))
    return BackwardCopies(params, "worker1", SimpleNamespace(message=flat.message), recorder), recorder


def _step(model: nn.Module, copies: BackwardCopies, slot: int, x: torch.Tensor | None = None) -> int:
    """One backward and its push from `slot`: how many copies started during the backward."""
    recorder = copies.copies
    assert isinstance(recorder, Recorder)
    before = len(recorder.copies)
    copies.arm(lambda: slot)
    model(torch.randn(16, 64) if x is None else x).pow(2).sum().backward()
    during = len(recorder.copies) - before
    assert copies.finish(slot)[0] == "landed"
    return during


def test_from_the_second_backward_each_partition_is_copied_as_it_completes_last_layers_first():
    model = Deep()
    copies, recorder = _copies(model, 64 * 64)  # one linear layer each
    assert len(recorder.pieces) == 5  # 4 linears, then the BatchNorm's parameters with its buffers
    assert _step(model, copies, 0) == 0  # the first backward only counts: all of it at the push
    assert recorder.copies == [(0, j) for j in range(5)]
    recorder.copies = []
    assert _step(model, copies, 1) == 4
    # the backward finishes the last linear first; partition 4 (here the BatchNorm, which is
    # last, with the buffers) is copied at the push, and the push's event comes after every copy
    assert recorder.copies == [(1, 3), (1, 2), (1, 1), (1, 0), (1, 4)] and recorder.landed_after == 5


def test_a_weight_used_twice_is_copied_once_its_whole_gradient_is_in():
    """Autograd sums a shared weight's two contributions before it accumulates them: its hook
    fires once, with the whole gradient."""
    layer = nn.Linear(64, 64, bias=False)
    model = nn.Sequential(layer, nn.ReLU(), layer, nn.Linear(64, 64, bias=False))
    copies, recorder = _copies(model, 64 * 64)
    _step(model, copies, 0)
    recorder.copies = []
    assert _step(model, copies, 0) == 1 and recorder.copies == [(0, 0), (0, 1)]


class Unused(nn.Module):
    """A parameter the forward never uses: its gradient never comes."""

    def __init__(self) -> None:
        super().__init__()
        self.used, self.spare = nn.Linear(64, 64), nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def test_a_parameter_whose_gradient_never_comes_leaves_every_copy_to_the_push():
    model = Unused()
    copies, recorder = _copies(model, 64)
    _step(model, copies, 0)
    recorder.copies = []
    assert _step(model, copies, 0) == 0 and sorted(recorder.copies) == [(0, j) for j in range(len(recorder.pieces))]


class Skipping(nn.Module):
    """Three linear layers; with `skip` the forward leaves the middle one out."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = (nn.Linear(64, 64, bias=False) for _ in range(3))
        self.skip = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.a(x) if self.skip else self.b(self.a(x)))


def test_a_backward_whose_hooks_did_not_each_fire_once_is_copied_whole_at_the_push():
    """The order of the first backward is every backward's (DDP's static graph): one that leaves
    a partition out has nothing it copied early trusted, and its push copies every partition."""
    model = Skipping()
    copies, recorder = _copies(model, 64 * 64)  # a, b, then c (copied at the push)
    _step(model, copies, 0)
    recorder.copies = []
    assert _step(model, copies, 0) == 2 and recorder.copies == [(0, 1), (0, 0), (0, 2)]
    recorder.copies = []
    model.skip = True
    assert _step(model, copies, 0) == 1  # a's, as the backward finishes it; b's hook never fires
    assert recorder.copies == [(0, 0), (0, 0), (0, 1), (0, 2)]


def test_a_gpu_workers_forward_waits_only_for_the_partitions_each_module_needs():
    """app.exchange.ordered_pull: a module waits for the partitions its own parameters are in (and the
    buffers, copied first, when it has some); the first layer never for the last partition."""
    from app.exchange.ordered_pull import waits

    model = Deep()
    parts = cut([p.numel() for p in model.parameters()], FlatModel(model).size, 64 * 64)
    got = {name: waits(model, parts).get(module) for name, module in model.named_modules()}
    assert got["layers.0"] == ([0], False) and got["layers.3"] == ([3], False)
    assert got["layers.4"] == ([4], True)  # the BatchNorm: its parameters in the last partition, and buffers
    assert got[""] is None and got["layers"] is None  # containers have nothing of their own
