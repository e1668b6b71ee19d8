"""Delayed Nesterov momentum (app.training.delayed_nesterov), diloco_async's outer optimizer, and
its state through a PS checkpoint."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from app.config import parse
from app.ps.server import ParameterServer, ServerConfig
from app.training.delayed_nesterov import DelayedNesterov

from app_testkit import push, submit


def _stepped(optimizer_of, grads: list[torch.Tensor]) -> torch.Tensor:
    p = nn.Parameter(torch.linspace(-1, 1, 6))
    optimizer = optimizer_of([p])
    for g in grads:
        p.grad = g.clone()
        optimizer.step()
    return p.detach()


def _grads(n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(6, generator=g) for _ in range(n)]


def test_with_a_period_of_one_it_is_torchs_nesterov_sgd():
    grads = _grads(5)
    ours = _stepped(lambda ps: DelayedNesterov(ps, lr=0.7, momentum=0.9, period=1), grads)
    torchs = _stepped(lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True), grads)
    assert torch.allclose(ours, torchs, rtol=1e-6, atol=1e-6)


def test_period_changes_in_a_row_are_one_nesterov_step_with_their_mean():
    """Three rounds of 3 arrivals each: synchronous DiLoCo's outer steps on each round's mean."""
    grads = _grads(9, seed=1)
    ours = _stepped(lambda ps: DelayedNesterov(ps, lr=0.7, momentum=0.9, period=3), grads)
    means = [torch.stack(grads[i : i + 3]).mean(0) for i in (0, 3, 6)]
    torchs = _stepped(lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True), means)
    assert torch.allclose(ours, torchs, rtol=1e-5, atol=1e-6)


def test_between_momentum_steps_each_change_is_plain_sgd_at_lr_over_the_period():
    grads = _grads(2, seed=2)
    ours = _stepped(lambda ps: DelayedNesterov(ps, lr=0.6, momentum=0.9, period=3), grads)
    assert torch.allclose(ours, torch.linspace(-1, 1, 6) - 0.2 * (grads[0] + grads[1]), atol=1e-6)


@pytest.mark.parametrize("period", [0, 1.5, True])
def test_a_period_that_is_not_a_whole_number_of_arrivals_is_refused(period):
    with pytest.raises(ValueError, match="invalid period"):
        DelayedNesterov([nn.Parameter(torch.zeros(2))], period=period)


def _server(workers: int = 2) -> ParameterServer:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    flags = ["--strategy", "diloco_async", "--world_size", str(workers + 1)]
    server = ParameterServer(model, ServerConfig.from_config(parse(["ps", *flags], {})))
    for rank in range(1, workers + 1):
        server.join(rank, f"worker{rank}")
    return server


def test_diloco_async_momentum_state_survives_a_checkpoint_and_resume_exactly():
    """3 changes, a checkpoint mid-period, 4 more: the resumed PS ends value for value where the
    one that never stopped does (the buffer, the sum and the count of arrivals are restored)."""
    changes = _grads(7, seed=3)
    changes = [torch.cat([c, c[:4], c[:5]]) for c in changes]  # 15 values: the model's
    kept = _server()
    for i, c in enumerate(changes[:3]):
        push(kept, 1 + i % 2, c, kept.version)
    saved = kept.state.checkpoint()
    resumed = _server()
    resumed.state.restore(saved)
    for i, c in enumerate(changes[3:], start=3):
        for server in (kept, resumed):
            push(server, 1 + i % 2, c, server.version)
    state = resumed.state.optimizer.state_dict()["state"]
    assert resumed.version == kept.version == 7 and int(state[0]["arrivals"]) == 7
    assert torch.equal(resumed.state.vector, kept.state.vector)
    fresh = _server()  # the checkpoint's model and version, without the optimizer's state
    fresh.state.restore({**saved, "optimizer": fresh.state.optimizer.state_dict()})
    for i, c in enumerate(changes[3:], start=3):
        push(fresh, 1 + i % 2, c, fresh.version)
    assert not torch.equal(fresh.state.vector, kept.state.vector)  # the optimizer's state mattered


@pytest.mark.parametrize("strategy", ["diloco", "diloco_async"])
def test_a_ps_shard_steps_its_slice_as_the_whole_ps_steps_it(strategy):
    """The outer optimizer (Nesterov SGD, delayed Nesterov) is elementwise: a shard serving values
    4..11 of the state ends where the whole PS's values 4..11 end."""
    flags = ["--strategy", strategy, "--world_size", "3"]
    config = parse(["ps", *flags], {})
    whole = ParameterServer(_model_for_shards(), ServerConfig.from_config(config))
    part = ParameterServer(_model_for_shards(), ServerConfig.from_config(config, (4, 11)))
    for server in (whole, part):
        for rank in (1, 2):
            server.join(rank, f"worker{rank}")
    changes = [torch.cat([c, c, c[:3]]) for c in _grads(6, seed=5)]  # 15 values: the model's
    for i, c in enumerate(changes):
        rank = 1 + i % 2
        waiting = [submit(whole, rank, c, whole.version), submit(part, rank, c[4:11].clone(), part.version)]
        if strategy == "diloco" and rank == 1:
            continue  # the round closes with rank 2's change
        for future in waiting:
            future.wait()
    assert whole.version == (3 if strategy == "diloco" else 6) == part.version
    assert torch.allclose(part.state.vector, whole.state.vector[4:11], rtol=1e-6, atol=1e-7)


def _model_for_shards() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(4, 3)
