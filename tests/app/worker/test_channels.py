"""A worker's route to its PS (app.exchange.route, app.worker.channels): what it stages, what it
makes of a refusal."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from app.config import UsageError, parse
from app.contract import PS
from app.exchange import calls
from app.exchange.route import Pusher
from app.exchange.socket_route import SocketRoute
from app.exchange.wire import Push, Refusal
from app.ps import rpc as endpoints
from app.worker.trainer import Trainer

from app_testkit import ps_server, recording_channel, started


def _linear(size: int, value: float = 0.0) -> nn.Module:
    model = nn.Linear(size, 1, bias=False)
    nn.init.constant_(model.weight, value)
    return model


def test_overlap_staging_never_reuses_the_buffer_of_the_push_still_on_the_wire():
    config = parse(["worker", "--overlap", "true"], {})
    channel = recording_channel(overlap=True)
    trainer = Trainer(config, _linear(4), None, None, torch.device("cpu"), channel, None)
    started(trainer)
    channel.real.staging = [torch.empty(4) for _ in range(2)]  # what a CUDA worker has (pinned)
    for _ in range(5):
        trainer.push_and_pull()
    pointers = [m.data_ptr() for m in channel.messages]
    assert all(a != b for a, b in zip(pointers, pointers[1:])), pointers


def test_a_stale_incarnations_push_is_a_refusal_value_and_the_worker_exits_with_usage_error():
    server = ps_server(_linear(4), lr=1.0, momentum=0.0, num_trainers=1)
    server.join(1, "worker1_r2")
    with endpoints.Endpoint(server).serving():
        future = calls.rpc_push(torch.ones(4), Push(1, "worker1", 0))
        answer = future.wait()  # a value: what RPC carries back is a normal reply
        assert isinstance(answer, Refusal) and answer.kind == "stale"
        assert "worker1 was replaced by worker1_r2" in answer.message
        assert isinstance(calls.rpc_finish(1, 3, "worker1"), Refusal)
    route = SocketRoute(Pusher(1, "worker1", "nowhere", 10.0), PS, 0, 4)
    with pytest.raises(UsageError, match="worker1 was replaced by worker1_r2"):
        route.answer(future)
