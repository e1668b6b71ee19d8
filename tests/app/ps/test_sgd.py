"""The PS's SGD (app.ps.sgd): torch.optim.SGD's steps bit for bit, its state_dict both ways, and
no torch._dynamo import at a PS's start."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from app.ps.sgd import SGD

ROOT = Path(__file__).resolve().parents[3]
SETTINGS = [(0.0, 0.0), (0.9, 0.0), (0.0, 0.05), (0.9, 0.05)]


def _grads(steps: int, size: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randn(size, generator=generator) for _ in range(steps)]


def _pair(momentum: float, weight_decay: float) -> tuple[nn.Parameter, SGD, nn.Parameter, torch.optim.SGD]:
    start = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    ours, theirs = nn.Parameter(start.clone()), nn.Parameter(start.clone())
    kwargs = {"lr": 0.1, "momentum": momentum, "weight_decay": weight_decay}
    return ours, SGD(ours, **kwargs), theirs, torch.optim.SGD([theirs], **kwargs)


def _torch_step(param: nn.Parameter, optimizer: torch.optim.SGD, grads: torch.Tensor) -> None:
    param.grad = grads.clone()
    optimizer.step()
    param.grad = None


@pytest.mark.parametrize(("momentum", "weight_decay"), SETTINGS)
def test_each_step_is_torch_optim_sgds_bit_for_bit(momentum, weight_decay):
    ours, sgd, theirs, optimizer = _pair(momentum, weight_decay)
    for grads in _grads(5, 1000):
        sgd.step(grads.clone())
        _torch_step(theirs, optimizer, grads)
        assert torch.equal(ours.detach(), theirs.detach())
    mine, torchs = sgd.state_dict(), optimizer.state_dict()
    assert mine["param_groups"] == torchs["param_groups"]
    assert mine["state"].keys() == torchs["state"].keys()
    if momentum:
        assert torch.equal(mine["state"][0]["momentum_buffer"], torchs["state"][0]["momentum_buffer"])


@pytest.mark.parametrize(("momentum", "weight_decay"), SETTINGS)
def test_a_state_dict_moves_either_way_and_the_steps_go_on_equal(momentum, weight_decay):
    grads = _grads(7, 1000)
    ours, sgd, theirs, optimizer = _pair(momentum, weight_decay)
    for g in grads[:3]:
        _torch_step(theirs, optimizer, g)
    with torch.no_grad():
        ours.copy_(theirs)
    sgd.lr = 0.5  # the saved settings replace these, as in torch's optimizers
    sgd.load_state_dict(copy.deepcopy(optimizer.state_dict()))  # torch's checkpoint into ours
    for g in grads[3:6]:
        sgd.step(g.clone())
        _torch_step(theirs, optimizer, g)
        assert torch.equal(ours.detach(), theirs.detach())
    again = nn.Parameter(ours.detach().clone())
    other = torch.optim.SGD([again], lr=0.5)
    other.load_state_dict(copy.deepcopy(sgd.state_dict()))  # ours into torch's
    sgd.step(grads[6].clone())
    _torch_step(again, other, grads[6])
    assert torch.equal(ours.detach(), again.detach())


def test_a_saved_optimizer_this_sgd_cannot_continue_is_refused():
    param = nn.Parameter(torch.zeros(4))
    nesterov = torch.optim.SGD([param], lr=0.1, momentum=0.9, nesterov=True).state_dict()
    with pytest.raises(ValueError, match="nesterov"):
        SGD(param, lr=0.1).load_state_dict(nesterov)
    two = torch.optim.SGD([{"params": [param]}, {"params": [nn.Parameter(torch.zeros(2))]}], lr=0.1).state_dict()
    with pytest.raises(ValueError, match="2 parameter group"):
        SGD(param, lr=0.1).load_state_dict(two)


def test_a_ps_state_with_momentum_steps_without_importing_torch_dynamo():
    code = (
        "import sys, torch; from app.ps.state import State, StateConfig; from app.training import models; "
        "s = State(models.build('cnn', 1, 10, seed=0), StateConfig(lr=0.1, momentum=0.9, weight_decay=0.01)); "
        "s.step(torch.ones(s.size)); s.restore(s.checkpoint()); "
        "print(s.version, 'torch._dynamo' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert done.stdout.split() == ["1", "False"]
