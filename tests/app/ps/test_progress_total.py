"""The run's total updates as the PS knows it (ParameterServer.total_updates): the updates
applied plus what each rank's last push said it has still to make, per strategy."""

from __future__ import annotations

import torch
from torch import nn

from app_testkit import ps_server, push, submit


def _server(strategy: str, workers: int = 2):
    model = nn.Linear(4, 1, bias=False)
    nn.init.constant_(model.weight, 0.0)
    return ps_server(model, lr=0.1, num_trainers=workers, strategy=strategy)


GRAD = torch.ones(4)


def test_async_total_is_the_updates_applied_plus_every_ranks_pushes_to_go():
    server = _server("async")
    assert server.total_updates() is None  # no rank said yet
    push(server, 1, GRAD, 0, to_go=9)
    assert server.total_updates() is None  # rank 2 has not said: no number made up
    push(server, 2, GRAD, 1, to_go=9)
    assert server.total_updates() == 2 + 9 + 9
    for left in (8, 7):
        push(server, 1, GRAD, server.version, to_go=left)
    assert server.version == 4 and server.total_updates() == 20  # the plan holds as pushes land


def test_a_rank_that_leaves_takes_its_pushes_to_go_out_of_the_total():
    server = _server("async")
    for rank in (1, 2):
        server.join(rank, f"worker{rank}")
    push(server, 1, GRAD, 0, to_go=9)
    push(server, 2, GRAD, 1, to_go=9)
    server.leave(2, pushes=1, name="worker2")
    assert server.total_updates() == 2 + 9  # scaled down: only rank 1's are still to come
    push(server, 1, GRAD, 2, to_go=0)
    server.finish(1, pushes=2)
    assert server.total_updates() == server.version == 3


def test_a_worker_that_cannot_know_its_pushes_to_go_leaves_the_total_unknown():
    server = _server("async", workers=1)
    push(server, 1, GRAD, 0)  # to_go -1: a job that may be scaled
    assert server.total_updates() is None


def test_sync_total_is_one_update_a_round_until_the_rank_with_most_to_go_is_done():
    server = _server("sync")
    first = submit(server, 1, GRAD, 0, to_go=5)  # held: the round waits for rank 2
    push(server, 2, GRAD, 0, to_go=6)  # one shard holds a batch more than the other
    first.wait()
    assert server.version == 1
    assert server.total_updates() == 1 + 6
    held = submit(server, 1, GRAD, 1, to_go=4)  # the next round is open
    assert server.total_updates() == 1 + 6  # nothing applied yet: the open round is still to come
    push(server, 2, GRAD, 1, to_go=5)
    held.wait()
    assert server.version == 2 and server.total_updates() == 7
