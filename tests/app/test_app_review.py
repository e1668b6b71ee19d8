"""Regression tests for defects found in review (each failed on the code before its fix):
the ParameterServer, Trainer, Checkpointer and LivenessMonitor driven in-process, without RPC."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from app.checkpoint import files as checkpoint_files
from app.checkpoint.writer import Checkpointer
from app.config import UsageError, check_threads_env, parse
from app.contract import PS
from app.exchange import calls
from app.exchange.wire import Push, Refusal, Reply
from app.ps import rpc as endpoints
from app.ps.members.liveness import LivenessMonitor
from app.ps.server import ParameterServer
from app.training.metrics import MetricsWriter
from app.worker.channels import PSChannel, Route
from app.worker.compress import Compressor
from app.worker.trainer import MAX_REFUSED_IN_A_ROW, Trainer

from app_testkit import recording_channel, started


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _linear(size: int, value: float = 0.0) -> nn.Module:
    model = nn.Linear(size, 1, bias=False)
    nn.init.constant_(model.weight, value)
    return model


def _bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))


# 1. GPU --overlap: two pushes on the wire at once never share a staging buffer


def test_overlap_staging_never_reuses_the_buffer_of_the_push_still_on_the_wire():
    config = parse(["worker", "--overlap", "true"], {})
    channel = recording_channel(overlap=True)
    trainer = Trainer(config, _linear(4), None, None, torch.device("cpu"), channel, None)
    started(trainer)
    channel.staging = [torch.empty(4) for _ in range(2)]  # what a CUDA worker has (pinned)
    for _ in range(5):
        trainer.push_and_pull()
    pointers = [m.data_ptr() for m in channel.messages]
    assert all(a != b for a, b in zip(pointers, pointers[1:])), pointers


# 2. staleness_lr scales the gradient, so momentum does not carry it at full weight


def _displacement(staleness: int) -> float:
    server = ParameterServer(_linear(1), lr=1.0, momentum=0.9, num_trainers=2, staleness_lr=True)
    for version in range(staleness):
        server.push(2, torch.zeros(1), version)  # other pushes: the state moves on, not the weights
    server.push(1, torch.ones(1), 0)
    for _ in range(200):
        server.push(2, torch.zeros(1), server.version)
    return -server.state.item()


def test_staleness_lr_with_momentum_moves_a_stale_gradient_a_quarter_as_far():
    assert _displacement(4) / _displacement(0) == pytest.approx(0.25, rel=1e-4)


# 3. sharded PS: one version and one staleness per push, from the main PS


def test_a_shard_takes_the_staleness_the_main_ps_computed():
    whole = ParameterServer(_linear(4), lr=1.0, momentum=0.0, num_trainers=2, staleness_lr=True)
    shard = ParameterServer(_linear(4), lr=1.0, momentum=0.0, num_trainers=2, staleness_lr=True, part=(2, 4))
    for server in (whole, shard):
        server.push(2, torch.zeros(server.size), 0)
        server.push(2, torch.zeros(server.size), 1)
    reply = whole.push(1, torch.ones(4), 0)  # staleness 2 on the main PS
    # the shard got rank 1's push before rank 2's: by its own count the push is fresh
    fresh = ParameterServer(_linear(4), lr=1.0, momentum=0.0, num_trainers=2, staleness_lr=True, part=(2, 4))
    got = fresh.push(1, torch.ones(2), 0, staleness=reply.staleness)
    assert got.staleness == reply.staleness == 2
    assert torch.equal(got.vector, reply.vector[2:4])


# 4. non-finite values: flags, OMP_NUM_THREADS, pushes


@pytest.mark.parametrize(
    "flag,value",
    [
        ("--lr", "nan"),
        ("--momentum", "nan"),
        ("--rpc_timeout", "inf"),
        ("--rpc_timeout", "nan"),
        ("--join_timeout", "nan"),
        ("--join_timeout", "inf"),
        ("--lr", "-inf"),
    ],
)
def test_non_finite_float_flags_are_refused_naming_the_flag(flag, value):
    with pytest.raises(UsageError, match=f"^{flag}: {value} is not a finite number"):
        parse(["ps", f"{flag}={value}"], {})


@pytest.mark.parametrize("value", ["4,2", "0", "abc", "-1"])
def test_a_bad_omp_num_threads_is_refused(value):
    with pytest.raises(UsageError, match=f"OMP_NUM_THREADS: '{value}' is not a positive integer"):
        check_threads_env({"OMP_NUM_THREADS": value})
    check_threads_env({"OMP_NUM_THREADS": "3"})
    check_threads_env({})


@pytest.mark.parametrize("strategy", ["async", "ssp", "sync"])
def test_a_non_finite_push_is_refused_counted_and_changes_nothing(strategy, caplog):
    server = ParameterServer(_linear(4), lr=1.0, momentum=0.0, num_trainers=1, strategy=strategy)
    before = server.state.clone()
    with caplog.at_level(logging.WARNING, logger="app.ps"):
        for bad in (float("nan"), float("inf"), float("nan")):
            reply = server.push(1, torch.tensor([1.0, bad, 0.0, 0.0]), 0)
            assert isinstance(reply, Refusal) and reply.kind == "nonfinite"
    assert server.version == 0 and torch.equal(server.state, before)
    assert server.tally.refused == {1: 3} and server.stats()["refused"] == {"worker1": 3}
    assert len([r for r in caplog.records if "non-finite" in r.getMessage()]) == 1  # once per worker
    assert isinstance(server.push(1, torch.ones(4), 0), Reply)


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


# 5. --compress: BatchNorm buffers cross in float32, only the gradients in 16 bits


@pytest.mark.parametrize("kind", ["bf16", "fp16"])
def test_compressed_pushes_carry_the_buffers_in_float32(kind):
    server = ParameterServer(_bn_model(), lr=0.1, momentum=0.0, num_trainers=1)
    n = server.num_params
    message = torch.zeros(server.flat.size)
    message[:n] = 0.5
    message[n:] = torch.tensor([1.0001, 0.3333333, 1.0009, 7.123457])  # not 16-bit values
    buffers = message[n:].clone()
    wire = Compressor(kind, n, torch.device("cpu"))(message)
    reply = server.push(1, wire, 0)
    assert torch.equal(reply.vector[n:], buffers)


def test_a_compressed_push_to_a_shard_straddling_params_and_buffers_decodes():
    whole = ParameterServer(_bn_model(), lr=0.1, momentum=0.0, num_trainers=1)
    n, size = whole.num_params, whole.flat.size
    message = torch.arange(size, dtype=torch.float32) / 7 + 1
    expected = message[n:].clone()
    wire = Compressor("bf16", n, torch.device("cpu"))(message)
    start, end = n - 2, size
    shard = ParameterServer(_bn_model(), lr=0.1, momentum=0.0, num_trainers=1, part=(start, end))
    reply = shard.push(1, Compressor.slice(wire, n, start, end), 0)
    assert torch.equal(reply.vector[2:], expected)


# 6. a replaced incarnation's push is answered with a refusal the worker understands


def test_a_stale_incarnations_push_is_a_refusal_value_and_the_worker_exits_with_usage_error():
    server = ParameterServer(_linear(4), lr=1.0, momentum=0.0, num_trainers=1)
    server.join(1, "worker1_r2")
    with endpoints.ENDPOINT.serving(server):
        future = calls.rpc_push(torch.ones(4), Push(1, "worker1", 0))
        answer = future.wait()  # a value: what RPC carries back is a normal reply
        assert isinstance(answer, Refusal) and answer.kind == "stale"
        assert "worker1 was replaced by worker1_r2" in answer.message
        assert isinstance(calls.rpc_finish(1, 3, "worker1"), Refusal)
    channel = PSChannel(1, timeout=10.0, address="nowhere")
    with pytest.raises(UsageError, match="worker1 was replaced by worker1_r2"):
        channel.answer(Route(PS, 0, 4), future)


# 7. drop answers the held push (sync and ssp)


@pytest.mark.parametrize("strategy", ["sync", "ssp"])
def test_drop_answers_the_held_push_of_the_dropped_rank(strategy):
    server = ParameterServer(_linear(4), lr=1.0, momentum=0.0, num_trainers=2, strategy=strategy, staleness=0)
    server.join(1, "worker1")
    server.join(2, "worker2")
    future = server.submit(2, torch.ones(4), 0, "worker2")  # ssp: one ahead of worker1, waits
    assert not future.done()
    assert server.drop(2, "worker2")
    assert future.done()
    reply = future.wait()
    assert isinstance(reply, (Reply, Refusal))


# 8. a finished worker is on disk at once


def test_a_finish_is_checkpointed_at_once_and_survives_a_restart(tmp_path):
    config = parse(["ps", "--checkpoint_dir", str(tmp_path), "--checkpoint_every", "1000"], {})

    def server() -> ParameterServer:
        return ParameterServer(_linear(4), lr=1.0, momentum=0.0, num_trainers=2, join_timeout=300)

    with MetricsWriter(str(tmp_path / "m"), "ps", "ps", 0) as metrics:
        first = server()
        checkpoints = Checkpointer(first, config, {"model_name": "linear"}, metrics)
        checkpoints.resume()
        first.on_finish = checkpoints.finished
        first.join(1, "worker1")
        first.push(1, torch.ones(4), 0)
        first.finish(1, 1, "worker1")
        restarted = server()
        Checkpointer(restarted, config, {"model_name": "linear"}, metrics).resume()
    assert restarted.finished == {1: 1} and restarted.version == 1


# 9. final.pt first; a failed write leaves no finished checkpoint, and is tried again


@pytest.mark.parametrize("then", ["room-made", "stopped"])
def test_a_failed_final_write_leaves_no_finished_checkpoint_and_is_tried_again(tmp_path, monkeypatch, then):
    """The PS holds the model while final.pt cannot be written (it was an OSError: the PS
    exited 1 and the model was lost). Each wait between tries is where room is made, or
    where SIGTERM comes (SystemExit): one more try, then the exit goes on."""
    from app.checkpoint import writer as checkpointer

    config = parse(["ps", "--checkpoint_dir", str(tmp_path)], {})
    server = ParameterServer(_linear(4), lr=1.0, momentum=0.0, num_trainers=1)
    server.join(1, "worker1")
    server.push(1, torch.ones(4), 0)
    server.finish(1, 1, "worker1")
    (tmp_path / "final.pt").mkdir()  # the rename onto it fails, as a full disk would
    waits = []

    def wait(seconds: float) -> None:
        waits.append(seconds)
        assert all(not checkpoint_files.verify(p)["finished"] for p in checkpoint_files.listing(tmp_path))
        if len(waits) == 2:
            if then == "stopped":
                raise SystemExit(143)
            (tmp_path / "final.pt").rmdir()

    monkeypatch.setattr(checkpointer.time, "sleep", wait)
    with MetricsWriter(str(tmp_path / "m"), "ps", "ps", 0) as metrics:
        saver = Checkpointer(server, config, {}, metrics)
        if then == "stopped":
            with pytest.raises(SystemExit):
                saver.final()
        else:
            saver.final()
    assert waits == [checkpointer.RETRY_SECONDS] * 2
    finished = [checkpoint_files.verify(p)["finished"] for p in checkpoint_files.listing(tmp_path)]
    if then == "stopped":
        assert (tmp_path / "final.pt").is_dir() and not any(finished)
        return
    assert torch.load(tmp_path / "final.pt", weights_only=True)["version"] == 1 and finished == [True]


# 12. a frozen worker (answers pings, never pushes) is reported and dropped under sync and ssp


@pytest.mark.parametrize("strategy", ["sync", "ssp"])
def test_a_worker_without_a_push_for_a_set_number_of_rpc_timeouts_is_dropped(strategy, caplog):
    clock = Clock()
    server = ParameterServer(
        _linear(4), lr=1.0, momentum=0.0, num_trainers=2, clock=clock, strategy=strategy, staleness=0
    )
    records = []
    liveness = LivenessMonitor(server, rpc_timeout=10, record=lambda event, step, **f: records.append((event, f)))
    server.join(1, "worker1")
    server.join(2, "worker2")
    pending = server.submit(1, torch.ones(4), 0, "worker1")  # waits for worker2
    clock.now = 10 * liveness.FROZEN_PERIODS - 1
    liveness.check_frozen()
    assert not pending.done() and not records
    clock.now = 10 * liveness.FROZEN_PERIODS + 1
    with caplog.at_level(logging.WARNING, logger="app.ps"):
        liveness.check_frozen()
    assert pending.done() and isinstance(pending.wait(), Reply)
    assert [e for e, _ in records] == ["frozen", "drop"] and records[0][1]["worker"] == "worker2"
    assert any("worker2" in r.getMessage() and "no push" in r.getMessage() for r in caplog.records)


def test_async_does_not_drop_a_quiet_worker():
    clock = Clock()
    server = ParameterServer(_linear(4), lr=1.0, momentum=0.0, num_trainers=2, clock=clock)
    liveness = LivenessMonitor(server, rpc_timeout=10, record=lambda *a, **f: None)
    server.join(2, "worker2")
    clock.now = 1000
    liveness.check_frozen()
    assert server.live_name(2) == "worker2"


# 15. Time: from every worker joined to the last push applied


def test_training_time_runs_from_all_joined_to_the_last_push_applied():
    clock = Clock()
    server = ParameterServer(_linear(4), lr=1.0, momentum=0.0, num_trainers=2, clock=clock)
    server.join(1, "worker1")
    clock.now = 5.0
    server.join(2, "worker2")
    clock.now = 6.0
    server.push(1, torch.ones(4), 0)
    clock.now = 9.0
    server.push(2, torch.ones(4), 1)
    server.finish(1, 1)
    clock.now = 30.0
    server.finish(2, 1)
    assert server.training_seconds() == pytest.approx(4.0)


# 11. DDP: a SIGTERM never splits a step from its label; rank 0 evaluates without holding up the others


def _ddp_trainer(optimizer_step=None, rank0=None):
    from app.allreduce import job as ddp

    config = parse(["worker", "--strategy", "allreduce", "--eval_every", "1"], {})
    model = _linear(4)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    if optimizer_step is not None:
        optimizer.step = optimizer_step(optimizer.step)
    state = ddp.JobState(model, optimizer)
    world = ddp.World(0, 1, "127.0.0.1", 1, 0, False)
    metrics = SimpleNamespace(write=lambda *a, **f: None)
    trainer = ddp.Trainer(
        config,
        world,
        _Wrapped(model),
        optimizer,
        state,  # type: ignore[arg-type]
        None,
        None,
        torch.device("cpu"),
        metrics,
        rank0,
    )
    return trainer, state


class _Wrapped(nn.Module):
    """What DDP looks like to the Trainer: the model as `.module`."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)


def test_a_sigterm_during_a_ddp_step_lands_after_the_step_and_its_label():
    import os
    import signal

    from app import runtime

    def sigterm_inside(step):
        def wrapped(*a, **k):
            result = step(*a, **k)
            os.kill(os.getpid(), signal.SIGTERM)  # after the weights moved, before the count
            return result

        return wrapped

    trainer, state = _ddp_trainer(sigterm_inside)
    previous = signal.signal(signal.SIGTERM, runtime._raise_exit)
    try:
        with pytest.raises(SystemExit):
            trainer.step(torch.ones(2, 4), torch.zeros(2, dtype=torch.long), epoch=1, batch=1)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert state.progress.step == 1 and state.progress.batch == 1  # the checkpoint's label matches


def test_rank0_evaluates_in_the_background_so_the_next_step_does_not_wait_for_it(monkeypatch):
    import threading

    from app.allreduce import job as ddp

    release, evaluated = threading.Event(), []

    def slow_accuracy(model, loader, device):
        release.wait(60)
        evaluated.append(model)
        return 0.5, 1.0

    monkeypatch.setattr(ddp, "held_out_accuracy", slow_accuracy)
    checkpoints = SimpleNamespace(due=lambda: False)
    trainer, state = _ddp_trainer(rank0=(checkpoints, None))
    state.progress = ddp.Progress(step=1)
    trainer.rank0_duties()  # returns while the evaluation is still blocked
    assert trainer.evaluating() and not evaluated
    release.set()
    trainer.wait_for_evaluation()
    assert len(evaluated) == 1 and evaluated[0] is not trainer.model.module  # a copy of the weights


# 10. shard checkpoints: written at the main PS's version, resumed at the version every shard has


def test_the_main_ps_writes_no_checkpoint_unless_every_shard_wrote_its_partner(tmp_path):
    config = parse(["ps", "--checkpoint_dir", str(tmp_path), "--checkpoint_every", "1"], {})
    server = ParameterServer(_linear(4), lr=1.0, momentum=0.0, num_trainers=1)
    asked = []

    def shard_fails(version: int) -> None:
        asked.append(version)
        raise RuntimeError("ps1 did not write its checkpoint labelled 1: disk full")

    with MetricsWriter(str(tmp_path / "m"), "ps", "ps", 0) as metrics:
        checkpoints = Checkpointer(server, config, {}, metrics)
        checkpoints.before_save = shard_fails
        server.push(1, torch.ones(4), 0)
        checkpoints.save("every 1 updates")
        assert asked == [1] and checkpoint_files.listing(tmp_path) == []
        checkpoints.before_save = asked.append
        server.push(1, torch.ones(4), 1)
        checkpoints.save("every 1 updates")
    assert asked == [1, 2] and [checkpoint_files.verify(p)["version"] for p in checkpoint_files.listing(tmp_path)] == [
        2
    ]


def test_a_shard_resumes_from_its_checkpoint_labelled_with_the_main_ps_version(tmp_path):
    from app.ps.sharding.shard_process import resume_shard

    shard = ParameterServer(_linear(4), lr=1.0, momentum=0.0, num_trainers=1, part=(2, 4))
    for label in (1, 2, 3):  # the shard wrote 3; the main PS crashed before writing its own
        shard.push(1, torch.ones(2), shard.version)
        checkpoint_files.save({**shard.checkpoint(), "label": label}, tmp_path)
    restarted = ParameterServer(_linear(4), lr=1.0, momentum=0.0, num_trainers=1, part=(2, 4))
    assert "labelled" not in resume_shard(restarted, tmp_path, None)
    assert restarted.version == 0
    resume_shard(restarted, tmp_path, 2)  # the main PS resumed from its version 2
    assert restarted.version == 2 and torch.equal(restarted.state, torch.full((2,), -2.0))
    with pytest.raises(RuntimeError, match="no checkpoint labelled 7"):
        resume_shard(restarted, tmp_path, 7)


def test_the_job_is_not_done_while_the_last_finish_is_being_recorded():
    server = ParameterServer(_linear(4), lr=1.0, momentum=0.0, num_trainers=1)
    seen = []
    server.on_finish = lambda rank: seen.append(server.done())
    server.join(1, "worker1")
    server.finish(1, 0, "worker1")
    assert seen == [False] and server.done()
