"""What a PS process serves over RPC (app.ps.rpc): the calls workers make, answered by the
endpoint over a real ParameterServer, as RPC runs them (the functions of app.exchange.calls)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from app.exchange import calls
from app.exchange.wire import InSlot, Joined, Push, Reply
from app.ps import rpc as endpoints

from app_testkit import ps_server


def _linear(size: int) -> nn.Module:
    model = nn.Linear(size, 1, bias=False)
    nn.init.zeros_(model.weight)
    return model


def test_a_ps_without_a_segment_offers_none_and_refuses_a_push_from_a_slot_with_one_clear_error():
    server = ps_server(_linear(4), lr=1.0, momentum=0.0, num_trainers=1)  # no segment: NO_SEGMENT
    with endpoints.Endpoint(server).serving():
        joined = calls.rpc_join(1, "worker1")
        assert isinstance(joined, Joined) and joined.exchange is None  # nothing to map
        with pytest.raises(RuntimeError, match="^this parameter server has no shared-memory segment$"):
            calls.rpc_push(InSlot(0, "float32", 4), Push(1, "worker1", 0))
        assert server.version == 0  # nothing applied
        answer = calls.rpc_push(torch.ones(4), Push(1, "worker1", 0)).wait()  # a tensor: applied as ever
        assert isinstance(answer, Reply) and torch.equal(answer.vector, torch.full((4,), -1.0))
    assert not server.replies.in_segment(answer.vector)  # the PS's own reply buffers


def test_the_calls_between_the_ps_processes_find_the_endpoint_in_the_same_table_as_the_workers():
    """One table (app.exchange.calls' `serving`): the endpoint installed there answers the
    workers' calls and the PS's own, with the hooks of its role; outside a serving, neither."""
    server = ps_server(_linear(4), lr=1.0, momentum=0.0, num_trainers=1)
    with pytest.raises(RuntimeError, match="no parameter server is serving in this process"):
        endpoints.rpc_resumed()
    registered = []
    main = endpoints.Main(lambda *shard: registered.append(shard), lambda: (7, "run"))
    with endpoints.Endpoint(server, main=main).serving():
        assert calls.service() is endpoints.endpoint()
        assert endpoints.rpc_resumed() == (7, "run")
        assert endpoints.rpc_register(1, "ps1", 2, (2, 4)) is None and registered == [(1, "ps1", 2, (2, 4))]
        assert endpoints.rpc_checkpoint(3) == "this shard is not serving yet"  # the main PS is no shard
        assert isinstance(calls.rpc_join(1, "worker1"), Joined)
        assert endpoints.rpc_drop(1, "worker1") and server.live_count() == 0
    with pytest.raises(RuntimeError, match="no parameter server is serving in this process"):
        calls.rpc_pull(1)


def test_a_shard_checkpoints_once_it_resumed_and_hears_the_end_through_its_endpoint():
    server = ps_server(_linear(4), lr=1.0, momentum=0.0, num_trainers=1, part=(0, 2))
    shard = endpoints.Shard()
    with endpoints.Endpoint(server, shard=shard).serving():
        assert endpoints.rpc_register(1, "ps1", 2, (2, 4)) == "the main parameter server runs with --shards 1"
        assert endpoints.rpc_resumed() is None
        assert endpoints.rpc_checkpoint(3) == "this shard is not serving yet"  # still resuming
        with shard.checkpointing(lambda version: f"labelled {version}"):
            assert endpoints.rpc_checkpoint(3) == "labelled 3"
            endpoints.rpc_end(True)
        assert shard.ended.is_set() and shard.finished
        assert endpoints.rpc_checkpoint(4) == "this shard is not serving yet"
