"""A worker's route to its PS (app.exchange.route, app.exchange.socket_route, app.worker.sharded):
what it stages, what it sends each PS process, what its wait loads, what it makes of a refusal
and of a PS process that is gone."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from app.config import UsageError, parse
from app.contract import PS
from app.exchange import calls
from app.exchange.route import Outgoing, PSUnreachable, Pusher
from app.exchange.socket_route import SocketRoute
from app.exchange.wire import Progress, Push, Refusal, Reply, Start
from app.ps import rpc as endpoints
from app.training.flat import FlatModel
from app.worker.compress import Compressor
from app.worker.sharded import ShardedRoute
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


def _answering(events: list, size: int, staleness: int):
    """A route's call (app.exchange.route.Call) to a PS process of `size` values, in this process:
    each push recorded in `events` as (to, push, message) and answered at once with a state of
    the number of pushes so far, one version past the one it was computed on."""

    def call(to, function, args, timeout):
        message, push = args
        events.append((to, push, message.clone()))
        reply = Reply(torch.full((size,), float(len(events))), push.pulled + 1, staleness, 0)
        return SimpleNamespace(wait=lambda: reply)

    return call


def _bound(route, size: int = 4) -> FlatModel:
    model = _linear(size)
    flat = FlatModel(model, own_buffers=True)
    versions = (0, 0) if isinstance(route, ShardedRoute) else 0
    route.bind(model, flat, Start(torch.zeros(size), versions, Progress(1, 0, 0)), True, True)
    return flat


def _sharded(events: list, chained: bool) -> ShardedRoute:
    pusher = Pusher(1, "worker1", "here")
    shards = [
        SocketRoute(pusher, PS, 0, 3, call=_answering(events, 3, staleness=2)),
        SocketRoute(pusher, "ps1", 3, 4, call=_answering(events, 1, staleness=0)),
    ]
    return ShardedRoute(pusher, shards, chained)


def test_one_ps_processs_route_makes_the_replys_state_the_models_as_its_wait_returns():
    events: list = []
    route = SocketRoute(Pusher(1, "worker1"), call=_answering(events, 4, staleness=0))
    flat = _bound(route)
    pending = route.push(route.seal(flat.pack_message()), 3, epoch=2, batch=5, samples=8, to_go=7)
    ((to, push, _),) = events
    assert to == PS and (push.pulled, push.epoch, push.batch, push.samples, push.to_go) == (3, 2, 5, 8, 7)
    assert torch.equal(flat.vector, torch.zeros(4))  # nothing loaded before the wait
    reply = pending.wait()
    assert isinstance(reply, Reply) and reply.version == 4 and torch.equal(flat.vector, torch.ones(4))


def test_a_chained_sharded_push_sends_the_rest_with_the_main_ps_staleness_and_loads_the_whole_reply():
    events: list = []
    route = _sharded(events, chained=True)
    flat = _bound(route)
    pending = route.push(route.seal(torch.arange(4.0)), (5, 7), to_go=9)
    assert [to for to, _, _ in events] == [PS]  # the main PS's slice only, until it answered
    reply = pending.wait()
    assert [to for to, _, _ in events] == [PS, "ps1"]
    (_, main, first), (_, other, second) = events
    assert (main.pulled, main.staleness, main.to_go) == (5, None, 9)
    assert (other.pulled, other.staleness, other.to_go) == (7, 2, -1)
    assert torch.equal(first, torch.arange(3.0)) and torch.equal(second, torch.tensor([3.0]))
    assert isinstance(reply, Reply) and (reply.version, reply.staleness) == ((6, 8), 2)
    assert torch.equal(flat.vector, torch.tensor([1.0, 1.0, 1.0, 2.0]))  # the slices put together, the model's


def test_an_unchained_sharded_push_sends_every_slice_at_once_and_a_compressed_one_its_part():
    events: list = []
    route = _sharded(events, chained=False)
    _bound(route)
    wire = Compressor("bf16", 4, torch.device("cpu"))(torch.arange(4.0))
    pending = route.push(route.seal(wire), (0, 0))
    assert [to for to, _, _ in events] == [PS, "ps1"]
    assert [m.dtype for _, _, m in events] == [torch.bfloat16] * 2
    assert torch.equal(events[0][2], wire[:3]) and torch.equal(events[1][2], wire[3:])
    assert isinstance(pending.wait(), Reply)


def test_a_sharded_push_of_non_finite_values_is_refused_before_any_shard_has_a_slice():
    events: list = []
    route = _sharded(events, chained=False)
    flat = _bound(route)
    answer = route.push(route.seal(torch.tensor([0.0, float("nan"), 0.0, 0.0])), (0, 0)).wait()
    assert isinstance(answer, Refusal) and answer.kind == "nonfinite" and events == []
    assert "worker1 computed non-finite values" in answer.message and torch.equal(flat.vector, torch.zeros(4))


def test_a_push_the_worker_proved_finite_says_so_and_an_unproven_one_does_not():
    events: list = []
    route = SocketRoute(Pusher(1, "worker1"), call=_answering(events, 4, staleness=0))
    flat = _bound(route)
    message = flat.pack_message()
    route.push(Outgoing(message, flags=torch.tensor(True)), 0).wait()
    route.push(Outgoing(message), 0).wait()  # no proof: the PS checks it
    route.push(Outgoing(message, flags=torch.tensor([True, False])), 0).wait()  # a partition not proven
    assert [push.finite for _, push, _ in events] == [True, False, False]


def test_a_sharded_push_checked_by_the_worker_is_sent_to_every_shard_as_finite():
    events: list = []
    route = _sharded(events, chained=False)
    _bound(route)
    route.push(route.seal(torch.arange(4.0)), (0, 0)).wait()  # unproven: checked here, once for all
    assert [(to, push.finite) for to, push, _ in events] == [(PS, True), ("ps1", True)]


def test_a_ps_process_that_is_gone_is_named_in_one_line():
    def gone(to, function, args, timeout):
        raise RuntimeError("connection refused\nand more")

    shard = SocketRoute(Pusher(1, "worker1", "/run/psc/ps.sock"), "ps1", 2, 4, call=gone)
    with pytest.raises(PSUnreachable, match=r"^lost parameter server shard ps1 \(job at /run/psc/ps.sock\) "):
        shard.send(Outgoing(torch.ones(2)), Push(1, "worker1", 0))

    def lost(to, function, args, timeout):
        return SimpleNamespace(wait=lambda: gone(to, function, args, timeout))

    route = SocketRoute(Pusher(1, "worker1", "/run/psc/ps.sock"), call=lost)
    flat = _bound(route)
    pending = route.push(route.seal(flat.pack_message()), 0)
    with pytest.raises(PSUnreachable) as raised:
        pending.wait()
    assert str(raised.value) == "lost the parameter server at /run/psc/ps.sock during rpc_push: connection refused"
