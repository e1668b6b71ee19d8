"""diloco and diloco_async (app.worker.local_steps, the PS's outer optimizer): a worker's local
steps and the change it pushes, against the same arithmetic done by hand with torch.optim."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from app.config import parse
from app.ps.server import ParameterServer, ServerConfig
from app.worker.trainer import Trainer

from app_testkit import push, recording_channel, started

INNER = '{"name":"adamw","lr":0.05,"betas":[0.9,0.95],"weight_decay":0.1}'


def _flags(strategy: str, workers: int, *extra: str) -> list[str]:
    return [
        "--strategy", strategy, "--local_steps", "3", "--optimizer", INNER, "--loss", "mse",
        "--batch_size", "8", "--world_size", str(workers + 1), "--num_epochs", "1", *extra,
    ]  # fmt: skip


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 1))


def _batches(seed: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 5, generator=g), torch.randn(8, 1, generator=g)) for _ in range(n)]


def _server(strategy: str, workers: int, *extra: str) -> ParameterServer:
    server = ParameterServer(_model(), ServerConfig.from_config(parse(["ps", *_flags(strategy, workers, *extra)], {})))
    for rank in range(1, workers + 1):
        server.join(rank, f"worker{rank}")
    return server


def _worker(server: ParameterServer, strategy: str, workers: int, rank: int, batches, *extra: str) -> Trainer:
    config = parse(["worker", "--rank", str(rank), *_flags(strategy, workers, *extra)], {})
    channel = recording_channel(lambda message, version: push(server, rank, message.clone(), version))
    trainer = Trainer(config, _model(), batches, None, torch.device("cpu"), channel, None)
    started(trainer)
    return trainer


def _train(trainer: Trainer, batches) -> None:
    """The training loop's body for each batch: a step, and a push when one is due; then the rest."""
    for batch, (x, y) in enumerate(batches, start=1):
        trainer.compute_gradients(x, y)
        if trainer.due(len(y)):
            trainer.push_and_pull(1, batch, len(y))
        trainer.at = (1, batch)
    trainer.push_rest()


def _inner_by_hand(model: nn.Module, optimizer: torch.optim.Optimizer, batches) -> None:
    for x, y in batches:
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    """The worker's inner optimizer as torch.optim builds it: norms' and biases' (ndim <= 1) out of weight decay."""
    decay = [p for p in model.parameters() if p.ndim > 1]
    rest = [p for p in model.parameters() if p.ndim <= 1]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=0.05, betas=(0.9, 0.95))


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_diloco_with_one_worker_is_its_local_steps_then_nesterov_sgd_on_the_change():
    """Two rounds of 3 local AdamW steps each, the inner optimizer's state carried over: each
    push moves the state by SGD(lr 0.7, momentum 0.9, nesterov) with `start - after` as the
    gradient, and the worker continues from that state."""
    batches = _batches(1, 6)
    server = _server("diloco", 1)
    trainer = _worker(server, "diloco", 1, 1, batches)
    _train(trainer, batches)

    inner = _model()
    inner_opt = _adamw(inner)
    outer = nn.Parameter(_flat(_model()).clone())
    outer_opt = torch.optim.SGD([outer], lr=0.7, momentum=0.9, nesterov=True)
    for window in (batches[:3], batches[3:]):
        start = outer.detach().clone()
        _inner_by_hand(inner, inner_opt, window)
        outer.grad = start - _flat(inner)
        outer_opt.step()
        torch.nn.utils.vector_to_parameters(outer.detach().clone(), inner.parameters())  # the pull (a copy)

    assert server.version == 2 and trainer.pushes == 2
    assert torch.allclose(server.state.vector, outer.detach(), rtol=1e-5, atol=1e-6)
    assert torch.allclose(trainer.flat.params, outer.detach(), rtol=1e-5, atol=1e-6)


def test_diloco_with_two_workers_applies_the_average_of_their_changes():
    batches = {rank: _batches(10 + rank, 3) for rank in (1, 2)}
    server = _server("diloco", 2)
    trainers = {rank: _worker(server, "diloco", 2, rank, batches[rank]) for rank in (1, 2)}
    threads = [threading.Thread(target=_train, args=(trainers[r], batches[r])) for r in (1, 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not any(t.is_alive() for t in threads)

    start = _flat(_model())
    changes = []
    for rank in (1, 2):
        inner = _model()
        _inner_by_hand(inner, _adamw(inner), batches[rank])
        changes.append(start - _flat(inner))
    outer = nn.Parameter(start.clone())
    outer.grad = (changes[0] + changes[1]) / 2
    torch.optim.SGD([outer], lr=0.7, momentum=0.9, nesterov=True).step()

    assert server.version == 1  # one round
    assert torch.allclose(server.state.vector, outer.detach(), rtol=1e-5, atol=1e-6)
    for trainer in trainers.values():
        assert torch.equal(trainer.flat.params, server.state.vector)


def test_each_push_of_a_local_strategy_says_the_pushes_left_and_the_last_steps_are_pushed_too():
    """7 batches at 3 local steps: pushes after batches 3 and 6 and the last one's; each says
    what is left of the rank's pushes."""
    batches = _batches(2, 7)
    config = parse(["worker", *_flags("diloco_async", 1)], {})
    channel = recording_channel()
    trainer = Trainer(config, _model(), batches, None, torch.device("cpu"), channel, None)
    started(trainer)
    _train(trainer, batches)
    assert channel.to_go == [2, 1, 0] and trainer.pushes == 3 and trainer.local.steps == 7


def test_a_refused_change_takes_the_worker_back_to_the_state_it_pulled():
    from app.exchange.wire import Refusal

    batches = _batches(3, 3)
    config = parse(["worker", *_flags("diloco_async", 1)], {})
    channel = recording_channel(lambda message, version: Refusal("nonfinite", "worker1 pushed non-finite values"))
    trainer = Trainer(config, _model(), batches, None, torch.device("cpu"), channel, None)
    started(trainer)
    pulled = trainer.flat.params.clone()
    _train(trainer, batches)
    assert trainer.refused == 1 and torch.equal(trainer.flat.params, pulled)


def test_max_steps_counts_a_local_strategys_batches():
    config = parse(["worker", *_flags("diloco", 1, "--max_steps", "4")], {})
    trainer = Trainer(config, _model(), _batches(4, 9), None, torch.device("cpu"), recording_channel(), None)
    started(trainer)
    for batch, (x, y) in enumerate(_batches(4, 9), start=1):
        trainer.compute_gradients(x, y)
        if trainer.due(len(y)):
            trainer.push_and_pull(1, batch, len(y))
        if trainer.reached_max_steps():
            break
    assert batch == 4 and trainer.local.steps == 4


@pytest.mark.parametrize("strategy", ["diloco", "diloco_async"])
def test_overlap_and_staleness_lr_are_refused_with_local_steps(strategy):
    from app.config import UsageError

    for flag in ("--overlap", "--staleness_lr"):
        with pytest.raises((UsageError, SystemExit)):
            parse(["worker", *_flags(strategy, 1), flag, "true"], {})
