"""The ParameterServer object without RPC: the lock, SGD, staleness, checkpoints; models."""

from __future__ import annotations

import logging
import threading

import pytest
import torch
from torch import nn

from app.checkpoint.files import save_atomically
from app.config import UsageError
from app.exchange.wire import Refusal, Reply
from app.ps.counts import PushCounts
from app.ps.replies import ReplyBuffers
from app.training import models

from app_testkit import ps_server, push, submit


def _linear(size: int, value: float = 0.0) -> nn.Module:
    model = nn.Linear(size, 1, bias=False)
    nn.init.constant_(model.weight, value)
    return model


def test_concurrent_pushes_are_all_applied_exactly():
    # Integer gradients and lr 1: the exact result does not depend on the order,
    # and a lost or torn update shows. The vector is large so that an unlocked
    # read-modify-write would overlap between threads.
    threads, pushes, size = 8, 40, 1 << 20
    server = ps_server(_linear(size), lr=1.0, momentum=0.0, num_trainers=threads)
    start = threading.Barrier(threads)
    # What each thread saw, asserted below in the test's own thread (an assert or an
    # exception inside a thread would only be printed, never fail the test).
    stalenesses: dict[int, list[int]] = {r: [] for r in range(1, threads + 1)}
    errors: dict[int, BaseException] = {}

    def worker(rank: int) -> None:
        try:
            grad = torch.full((size,), float(rank))
            start.wait(timeout=60)
            version = 0
            for _ in range(pushes):
                answer = push(server, rank, grad, version)
                version, staleness = answer.version, answer.staleness
                stalenesses[rank].append(staleness)
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            errors[rank] = e

    pool = [threading.Thread(target=worker, args=(r,)) for r in range(1, threads + 1)]
    for t in pool:
        t.start()
    for t in pool:
        t.join(timeout=120)
    assert not [t.name for t in pool if t.is_alive()], "pushing threads still running after 120 s"
    assert errors == {}, errors
    assert all(len(seen) == pushes and min(seen) >= 0 for seen in stalenesses.values()), stalenesses
    expected = -float(pushes * sum(range(1, threads + 1)))
    vector, version = server.pull(rank=0)
    assert version == threads * pushes
    assert torch.equal(vector, torch.full((size,), expected))
    assert server.members.pushes == {r: pushes for r in range(1, threads + 1)}


def test_staleness_is_versions_since_the_pull():
    server = ps_server(_linear(4), lr=0.5, momentum=0.0, num_trainers=2)
    grad = torch.ones(4)
    assert push(server, 1, grad, 0)[1:3] == (1, 0)
    assert push(server, 2, grad, 0)[1:3] == (2, 1)
    assert push(server, 1, grad, 1)[1:3] == (3, 1)
    assert server.stats()["staleness_max"] == 1


def test_flat_sgd_with_momentum_matches_torch_sgd_on_the_model():
    torch.manual_seed(0)
    reference = models.build("cnn", 1, 10, seed=0)
    server = ps_server(models.build("cnn", 1, 10, seed=0), lr=0.1, momentum=0.9, num_trainers=1)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        grads = [torch.randn_like(p) for p in reference.parameters()]
        for p, g in zip(reference.parameters(), grads):
            p.grad = g
        optimizer.step()
        vector = push(server, 1, torch.cat([g.flatten() for g in grads]), step).vector
    expected = torch.nn.utils.parameters_to_vector(reference.parameters())
    assert torch.allclose(vector, expected, atol=1e-6)


def test_buffers_in_a_push_replace_the_global_ones():
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    server = ps_server(model, lr=0.1, momentum=0.0, num_trainers=1)
    message = torch.zeros(server.state.flat.size)
    message[-4:] = torch.tensor([1.0, 2.0, 3.0, 4.0])  # running_mean, running_var
    vector = push(server, 1, message, 0).vector
    model = server.state.model  # the model, read, follows the state
    assert torch.equal(model[1].running_mean, torch.tensor([1.0, 2.0]))
    assert torch.equal(vector[-4:], message[-4:])


def test_a_push_of_the_wrong_size_is_refused_and_changes_nothing():
    server = ps_server(_linear(4), lr=1.0, momentum=0.0, num_trainers=1)
    with pytest.raises(ValueError, match="worker3 pushed 5"):
        push(server, 3, torch.ones(5), 0)
    assert server.version == 0


def test_all_finished_after_every_worker_reports():
    server = ps_server(_linear(2), lr=1.0, momentum=0.0, num_trainers=2)
    server.finish(1, 10)
    server.wait(until_version=100, timeout=0.01)
    assert not server.all_finished
    server.finish(2, 12)
    server.wait(until_version=100, timeout=5)
    assert server.all_finished and set(server.members.finished) == {1, 2}


def test_checkpoint_is_written_atomically_and_loads(tmp_path):
    server = ps_server(models.build("cnn", 1, 10, seed=0), lr=0.1, momentum=0.9, num_trainers=1)
    push(server, 1, torch.ones(server.state.flat.size), 0)
    path = tmp_path / "checkpoints" / "final.pt"
    save_atomically(server.checkpoint(), path)
    assert [p.name for p in path.parent.iterdir()] == ["final.pt"]
    state = torch.load(path)
    assert state["version"] == 1
    restored = models.build("cnn", 1, 10, seed=1)
    restored.load_state_dict(state["model"])
    assert torch.equal(torch.nn.utils.parameters_to_vector(restored.parameters()), server.state.flat.params)
    assert "momentum_buffer" in state["optimizer"]["state"][0]


def test_model_names():
    assert "cnn" in models.available()
    with pytest.raises(UsageError, match="unknown model 'nope'"):
        models.check("nope")
    out = models.build("cnn", 3, 7, seed=0)(torch.randn(2, 3, 32, 32))
    assert out.shape == (2, 7)


def test_replies_alternate_between_two_buffers_per_rank():
    server = ps_server(_linear(4), lr=1.0, momentum=0.0, num_trainers=2)
    first = push(server, 1, torch.ones(4), 0).vector
    second = push(server, 1, torch.ones(4), 1).vector
    assert torch.equal(first, torch.full((4,), -1.0))  # not overwritten by the next reply
    assert torch.equal(second, torch.full((4,), -2.0))
    other = push(server, 2, torch.ones(4), 2).vector
    third = push(server, 1, torch.ones(4), 3).vector
    assert third.data_ptr() == first.data_ptr() and other.data_ptr() not in (first.data_ptr(), second.data_ptr())
    assert torch.equal(third, torch.full((4,), -4.0)) and torch.equal(second, torch.full((4,), -2.0))


class _Segment:
    """A shared-memory segment's answer (app.exchange.ps_end.SharedExchange.reply_buffers): one
    region for rank 1, none for the others."""

    def __init__(self) -> None:
        self.region = torch.zeros(4)

    def reply_buffers(self, rank: int) -> list[torch.Tensor] | None:
        return [self.region] if rank == 1 else None


def test_reply_buffers_use_a_segments_region_and_two_of_their_own_for_other_ranks():
    segment = _Segment()
    replies = ReplyBuffers(4, segment)  # type: ignore[arg-type]  # the one method it calls
    assert replies.take(1) is segment.region
    assert replies.take(1) is segment.region  # one region: every reply of rank 1 is written there
    first, second = replies.take(2), replies.take(2)
    assert second is not first and replies.take(2) is first and replies.take(2) is second
    assert first.shape == (4,) and first.dtype == torch.float32


def test_the_push_counts_count_staleness_and_give_the_end_records_fields():
    counts = PushCounts()
    for staleness in (0, 1, 1, 3):
        counts.count(staleness)
    counts.refused[2] += 1
    counts.streamed = 2
    assert counts.fields({1: 3, 2: 1}) == {
        "pushes": {"worker1": 3, "worker2": 1},
        "staleness_mean": 1.25,
        "staleness_max": 3,
        "staleness_hist": {"0": 1, "1": 2, "3": 1},
        "refused": {"worker2": 1},
        "streamed": 2,
    }
    assert PushCounts().fields({})["staleness_mean"] == 0.0  # no push yet


def _bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 3))


@pytest.mark.parametrize("workers", [2, 3])
def test_a_sync_round_replies_what_one_process_gets_from_the_averaged_messages(workers):
    from app.training.flat import FlatModel

    server = ps_server(_bn_model(), lr=0.1, momentum=0.9, num_trainers=workers, strategy="sync")
    reference = FlatModel(_bn_model(), with_grads=False)
    param = nn.Parameter(reference.params)
    optimizer = torch.optim.SGD([param], lr=0.1, momentum=0.9)
    n = reference.num_params
    torch.manual_seed(1)
    for round_ in range(3):
        messages = [torch.randn(reference.size) for _ in range(workers)]
        pushed = [m.clone() for m in messages]
        futures = [submit(server, rank, m, round_) for rank, m in enumerate(messages, start=1)]
        replies = [f.wait() for f in futures]
        mean = torch.stack(pushed).mean(0)
        param.grad = mean[:n]
        optimizer.step()
        reference.vector[n:].copy_(mean[n:])  # the buffers: the average of the pushed ones
        assert all(r.vector is replies[0].vector for r in replies)  # one snapshot for the round
        assert torch.allclose(replies[0].vector, reference.vector, rtol=1e-6, atol=1e-7)
        assert all(torch.equal(m, p) for m, p in zip(messages, pushed))  # the pushes are untouched


def test_finite_values_whose_sum_overflows_are_applied_and_nan_or_inf_refused():
    from app.exchange.wire import Refusal, all_finite

    huge = torch.full((4,), 3e38)
    assert huge.sum().isinf() and all_finite(huge)
    for bad in (float("nan"), float("inf"), float("-inf")):
        assert not all_finite(torch.tensor([1.0, bad, 2.0, 3.0]))
    server = ps_server(_linear(4), lr=1e-38, momentum=0.0, num_trainers=1)
    server.join(1, "worker1")
    assert push(server, 1, huge, 0).version == 1
    refused = push(server, 1, torch.tensor([1.0, float("nan"), 0.0, 0.0]), 1)
    assert isinstance(refused, Refusal) and refused.kind == "nonfinite" and server.version == 1


@pytest.mark.parametrize("strategy", ["async", "ssp", "sync"])
def test_the_ps_step_is_torch_sgd_value_for_value_and_the_checkpoint_resumes_it(strategy):
    lr, momentum = 0.1, 0.9
    reference = _bn_model()
    optimizer = torch.optim.SGD(reference.parameters(), lr=lr, momentum=momentum)
    server = ps_server(_bn_model(), lr=lr, momentum=momentum, num_trainers=1, strategy=strategy)
    server.join(1, "worker1")
    n = server.state.num_params
    torch.manual_seed(2)
    replies = []
    for step in range(4):
        message = torch.randn(server.state.size)
        grads = message[:n].split([p.numel() for p in reference.parameters()])
        for p, g in zip(reference.parameters(), grads):
            p.grad = g.view_as(p).clone()
        optimizer.step()
        replies.append(push(server, 1, message, step).vector.clone())
        expected = torch.nn.utils.parameters_to_vector(reference.parameters())
        assert torch.equal(replies[-1][:n], expected)
        assert torch.equal(replies[-1][n:], message[n:])
        assert torch.equal(server.snapshot()[0], replies[-1])  # the reply is the state
        if step == 1:  # resume here: same momentum, same model
            state = server.checkpoint()
    resumed = ps_server(_bn_model(), lr=lr, momentum=momentum, num_trainers=1, strategy=strategy)
    resumed.restore(state)
    resumed.join(1, "worker1")
    torch.manual_seed(2)
    for step in range(4):
        message = torch.randn(server.state.size)
        if step >= 2:
            assert torch.equal(push(resumed, 1, message, step).vector, replies[step])
    assert torch.equal(torch.nn.utils.parameters_to_vector(resumed.state.model.parameters()), replies[-1][:n])


@pytest.mark.parametrize("strategy", ["async", "sync"])
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_weight_decay_on_the_ps_is_torch_sgds(strategy, momentum):
    """--weight_decay (train.weight_decay): the PS's step is torch.optim.SGD's with weight_decay,
    value for value, on both of its paths (the optimizer's step, and the one into a reply buffer)."""
    reference = models.build("cnn", 1, 10, seed=0)
    server = ps_server(
        models.build("cnn", 1, 10, seed=0),
        lr=0.1,
        momentum=momentum,
        num_trainers=1,
        strategy=strategy,
        weight_decay=0.05,
    )
    server.join(1, "worker1")
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=momentum, weight_decay=0.05)
    torch.manual_seed(3)
    for step in range(3):
        grads = [torch.randn_like(p) for p in reference.parameters()]
        for p, g in zip(reference.parameters(), grads):
            p.grad = g
        optimizer.step()
        vector = submit(server, 1, torch.cat([g.flatten() for g in grads]), step).wait().vector
        expected = torch.nn.utils.parameters_to_vector(reference.parameters())
        assert torch.allclose(vector[: expected.numel()], expected, atol=1e-6)
    assert not torch.allclose(
        expected, torch.nn.utils.parameters_to_vector(models.build("cnn", 1, 10, seed=0).parameters())
    )


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("strategy", ["async", "ssp", "sync"])
def test_a_non_finite_push_is_refused_counted_and_changes_nothing(strategy, caplog):
    server = ps_server(_linear(4), lr=1.0, momentum=0.0, num_trainers=1, strategy=strategy)
    before = server.state.vector.clone()
    with caplog.at_level(logging.WARNING, logger="app.ps"):
        for bad in (float("nan"), float("inf"), float("nan")):
            reply = push(server, 1, torch.tensor([1.0, bad, 0.0, 0.0]), 0)
            assert isinstance(reply, Refusal) and reply.kind == "nonfinite"
    assert server.version == 0 and torch.equal(server.state.vector, before)
    assert server.counts.refused == {1: 3} and server.stats()["refused"] == {"worker1": 3}
    assert len([r for r in caplog.records if "non-finite" in r.getMessage()]) == 1  # once per worker
    assert isinstance(push(server, 1, torch.ones(4), 0), Reply)


def test_training_time_runs_from_all_joined_to_the_last_push_applied():
    clock = Clock()
    server = ps_server(_linear(4), lr=1.0, momentum=0.0, num_trainers=2, clock=clock)
    server.join(1, "worker1")
    clock.now = 5.0
    server.join(2, "worker2")
    clock.now = 6.0
    push(server, 1, torch.ones(4), 0)
    clock.now = 9.0
    push(server, 2, torch.ones(4), 1)
    server.finish(1, 1)
    clock.now = 30.0
    server.finish(2, 1)
    assert server.training_seconds() == pytest.approx(4.0)


def test_the_job_is_not_done_while_the_last_finish_is_being_recorded():
    server = ps_server(_linear(4), lr=1.0, momentum=0.0, num_trainers=1)
    seen = []
    server.on_finish = lambda rank: seen.append(server.done())
    server.join(1, "worker1")
    server.finish(1, 0, "worker1")
    assert seen == [False] and server.done()


def test_an_evaluation_gets_the_rate_of_the_version_it_evaluates_however_far_training_went_on():
    """An eval line at update 3 says the rate of update 3, not of the version reached while the
    evaluation ran."""
    from app.ps.members.members import MembersConfig
    from app.ps.policies import PolicyConfig
    from app.ps.server import ParameterServer, ServerConfig
    from app.ps.state import Plan, StateConfig
    from app.recipes import lr_factor

    schedule = {"name": "linear"}
    state = StateConfig(1.0, schedule=schedule, plan=Plan(epochs=2))
    server = ParameterServer(_linear(4), ServerConfig(state, MembersConfig(1), PolicyConfig("async")))
    server.state.plan(5)  # as the first push that says its epoch's 5 batches plans it: 10 updates
    version = 0
    for _ in range(3):
        version = push(server, 1, torch.ones(4), version).version
    vector, evaluated, lr = server.evaluated()
    assert evaluated == 3 and lr == pytest.approx(lr_factor(schedule, 3, 10, 1.0)) and lr < 1.0
    for _ in range(3):  # training goes on while the evaluation runs
        version = push(server, 1, torch.ones(4), version).version
    assert server.state.lr < lr and torch.equal(vector, torch.full((4,), -(1.0 + 0.9 + 0.8)))
