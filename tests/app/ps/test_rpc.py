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
    with endpoints.ENDPOINT.serving(server):
        joined = calls.rpc_join(1, "worker1")
        assert isinstance(joined, Joined) and joined.exchange is None  # nothing to map
        with pytest.raises(RuntimeError, match="^this parameter server has no shared-memory segment$"):
            calls.rpc_push(InSlot(0, "float32", 4), Push(1, "worker1", 0))
        assert server.version == 0  # nothing applied
        answer = calls.rpc_push(torch.ones(4), Push(1, "worker1", 0)).wait()  # a tensor: applied as ever
        assert isinstance(answer, Reply) and torch.equal(answer.vector, torch.full((4,), -1.0))
    assert not server.replies.in_segment(answer.vector)  # the PS's own reply buffers
