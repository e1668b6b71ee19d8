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
