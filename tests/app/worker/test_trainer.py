"""The worker's training loop (app.worker.trainer) against a channel whose pushes go nowhere."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from app.config import parse
from app.exchange.wire import Refusal
from app.worker.trainer import MAX_REFUSED_IN_A_ROW, Trainer

from app_testkit import recording_channel, started


def _linear(size: int, value: float = 0.0) -> nn.Module:
    model = nn.Linear(size, 1, bias=False)
    nn.init.constant_(model.weight, value)
    return model


def test_a_worker_skips_refused_pushes_and_gives_up_after_a_run_of_them():
    config = parse(["worker"], {})

    channel = recording_channel(lambda message, version: Refusal("nonfinite", "worker1 pushed non-finite values"))
    trainer = Trainer(config, _linear(4), None, None, torch.device("cpu"), channel, None)
    started(trainer)
    for _ in range(MAX_REFUSED_IN_A_ROW - 1):
        assert trainer.push_and_pull() is None
    assert trainer.refused == MAX_REFUSED_IN_A_ROW - 1 and trainer.pushes == 0
    with pytest.raises(RuntimeError, match=f"{MAX_REFUSED_IN_A_ROW} pushes in a row were refused"):
        trainer.push_and_pull()


def test_an_epoch_one_worker_trains_says_so_in_the_singular(caplog):
    """`epoch 21 shared by 1 workers` was the line when a worker trained an epoch alone."""
    from types import SimpleNamespace

    config = parse(["worker", "--max_workers", "2"], {})
    channel = recording_channel()
    channel.shard = lambda: (0, 1)  # the PS has one rank training
    sampler = SimpleNamespace(shard=1, num_shards=2, fixed=False)
    trainer = Trainer(config, _linear(4), None, sampler, torch.device("cpu"), channel, None)
    with caplog.at_level("INFO", logger="app.worker"):
        trainer.reshard(21)
    assert caplog.messages == ["worker1: epoch 21 shared by 1 worker; share 0 is this one"]
    assert (sampler.shard, sampler.num_shards) == (0, 1)
