"""Failure handling without processes: roster, checkpoints (corrupt, truncated, disk full),
resume, shard skipping, a data directory that vanishes mid-run."""

from __future__ import annotations

import errno
import logging
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from app.checkpoint import files as checkpoint_files
from app.checkpoint.writer import Checkpointer
from app.config import UsageError, parse
from app.data import datasets
from app.exchange import group as membership
from app.exchange.wire import Refusal, Reply
from app.ps.members.liveness import LivenessMonitor
from app.ps.members.roster import DROPPED, FINISHED, LIVE, Roster, StaleIncarnation
from app.ps.server import ParameterServer
from app.training import models
from app.training.metrics import MetricsWriter

from app_testkit import digits, finished, free_port, ps_server, push, start_app, submit, wait_for


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_dropped_rank_resumes_in_a_new_process_and_the_old_one_is_refused():
    clock = Clock()
    roster = Roster([1, 2], join_timeout=30, clock=clock)
    roster.join(1, "worker1")
    roster.join(2, "worker2")
    roster.seen(2, "worker2")
    roster.record_push(2, epoch=3, batch=7)
    assert roster.drop(2, "worker2") and roster[2].state == DROPPED
    assert not roster.drop(2, "worker2")  # once
    assert roster.join(2, "worker2_r2").progress()._asdict() == {"epoch": 3, "batch": 7, "pushes": 1}
    with pytest.raises(StaleIncarnation, match="worker2 was replaced by worker2_r2"):
        roster.seen(2, "worker2")
    assert roster[2].state == LIVE


def test_a_dropped_process_that_calls_again_is_readmitted():
    roster = Roster([1], join_timeout=30, clock=Clock())
    roster.join(1, "worker1")
    roster.drop(1, "worker1")
    assert roster.seen(1, "worker1") is True and roster[1].state == LIVE
    assert roster.seen(1, "worker1") is False


def test_the_job_ends_when_all_finished_or_the_missing_are_past_join_timeout():
    clock = Clock()
    roster = Roster([1, 2], join_timeout=30, clock=clock)
    assert not roster.done()  # nobody joined yet
    roster.join(1, "worker1")
    roster.join(2, "worker2")
    roster.drop(2, "worker2")
    clock.now = 100
    assert not roster.done()  # worker1 still trains
    roster.finish(1, "worker1")
    assert roster.done() and [m.rank for m in roster.missing()] == [2]
    roster.join(2, "worker2_r2")
    assert not roster.done()  # back in time: wait for it
    roster.finish(2, "worker2_r2")
    assert roster.done() and roster.all_finished


def test_the_join_window_opens_when_the_ps_can_take_joins_not_when_it_was_made():
    """A PS slow to start (a loaded host, a shard still starting) does not count that time
    against the workers' join_timeout: it would give up on ranks that could not join yet."""
    clock = Clock()
    roster = Roster([1, 2], join_timeout=30, clock=clock)
    clock.now = 40  # the PS took 40 s to listen
    roster.open()
    clock.now = 65
    assert not roster.done() and roster.missing() == []
    clock.now = 70
    assert roster.done() and [m.rank for m in roster.missing()] == [1, 2]


def test_opening_the_window_again_restarts_it_for_dropped_ranks_but_not_for_live_or_finished_ones():
    clock = Clock()
    roster = Roster([1, 2, 3], join_timeout=30, clock=clock)
    roster.join(1, "worker1")
    roster.join(2, "worker2")
    roster.join(3, "worker3")
    roster.finish(1, "worker1")
    roster.drop(3, "worker3")
    clock.now = 50  # every shard is up again (one was lost)
    roster.open()
    assert [(m.rank, m.since) for m in roster.members.values()] == [(1, 0.0), (2, 0.0), (3, 50.0)]


def test_a_server_opened_late_waits_its_join_timeout_from_then():
    clock = Clock()
    server = ps_server(nn.Linear(2, 1), lr=0.1, num_trainers=2, join_timeout=30, clock=clock)
    clock.now = 45
    server.open_joins()
    clock.now = 60
    assert not server.done()
    clock.now = 76
    assert server.done()


def test_while_the_window_is_closed_no_rank_times_out_and_reopening_gives_each_its_whole_wait():
    """A sharded PS with a shard down: workers cannot join, so however long the shard takes
    to come back, the PS does not end for want of them."""
    clock = Clock()
    roster = Roster([1, 2], join_timeout=30, clock=clock)
    roster.join(1, "worker1")
    roster.close()  # a shard is lost
    roster.drop(1, "worker1")  # its worker lost the shard too
    clock.now = 500
    assert roster.missing() == [] and not roster.done()
    roster.open()  # every shard is up again
    clock.now = 529
    assert not roster.done()
    clock.now = 530
    assert roster.done() and [m.rank for m in roster.missing()] == [1, 2]


def test_a_server_with_joins_closed_does_not_end_until_they_open_and_its_wait_runs_out():
    clock = Clock()
    server = ps_server(nn.Linear(2, 1), lr=0.1, num_trainers=2, join_timeout=30, clock=clock)
    server.close_joins()
    clock.now = 300
    assert not server.done()
    server.open_joins()
    clock.now = 331
    assert server.done()


def test_a_finished_rank_stays_finished_across_a_checkpoint():
    roster = Roster([1, 2], join_timeout=30, clock=Clock())
    roster.join(1, "worker1")
    roster.record_push(1, 10, 15)
    roster.finish(1, "worker1")
    restored = Roster([1, 2], join_timeout=30, clock=Clock())
    restored.restore(roster.state())
    assert restored[1].state == FINISHED and restored[1].progress()._asdict() == {"epoch": 10, "batch": 15, "pushes": 1}


def _server(seed: int = 0) -> ParameterServer:
    return ps_server(models.build("cnn", 1, 10, seed=seed), lr=0.1, momentum=0.9, num_trainers=2)


def test_checkpoint_restores_model_optimizer_version_and_progress(tmp_path):
    server = _server()
    server.join(1, "worker1")
    for batch in (1, 2, 3):
        push(server, 1, torch.ones(server.state.flat.size), server.version, "worker1", epoch=2, batch=batch)
    path = checkpoint_files.save(server.checkpoint(), tmp_path)
    assert path.name.startswith("ckpt-00000003-")
    restored = _server(seed=1)
    restored.restore(checkpoint_files.verify(path))
    assert restored.version == 3 and torch.equal(restored.state.flat.vector, server.state.flat.vector)
    assert torch.equal(
        restored.state.optimizer.state_dict()["state"][0]["momentum_buffer"],
        server.state.optimizer.state_dict()["state"][0]["momentum_buffer"],
    )
    assert restored.join(1, "worker1_r2").progress._asdict() == {"epoch": 2, "batch": 3, "pushes": 3}


def _three_checkpoints(directory) -> list:
    server = _server()
    paths = []
    for _ in range(3):
        push(server, 1, torch.ones(server.state.flat.size), server.version)
        paths.append(checkpoint_files.save(server.checkpoint(), directory))
    return paths


@pytest.mark.parametrize("damage", ["truncate", "flip a byte", "empty"])
def test_a_damaged_newest_checkpoint_is_skipped_with_a_warning(tmp_path, caplog, damage):
    paths = _three_checkpoints(tmp_path)
    raw = bytearray(paths[-1].read_bytes())
    if damage == "truncate":
        raw = raw[: len(raw) // 2]
    elif damage == "flip a byte":
        raw[len(raw) // 2] ^= 0xFF
    else:
        raw = bytearray()
    paths[-1].write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING, logger="app.checkpoint"):
        path, state = checkpoint_files.newest_good(tmp_path)
    assert path == paths[-2] and state["version"] == 2
    assert f"skipping checkpoint {paths[-1]}" in caplog.text


def test_only_the_newest_few_are_kept(tmp_path):
    server = _server()
    for _ in range(checkpoint_files.KEEP + 2):
        push(server, 1, torch.ones(server.state.flat.size), server.version)
        checkpoint_files.save(server.checkpoint(), tmp_path)
    assert [int(p.name[5:13]) for p in checkpoint_files.listing(tmp_path)] == [5, 4, 3]


def test_a_full_disk_while_checkpointing_keeps_the_previous_one(tmp_path, monkeypatch):
    paths = _three_checkpoints(tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    real_fsync = checkpoint_files.os.fsync

    def full(fd: int) -> None:  # the data reached the file, the disk has no room for it
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint_files.os, "fsync", full)
    server = _server()
    with pytest.raises(OSError, match="No space left"):
        checkpoint_files.save(server.checkpoint(), tmp_path)
    monkeypatch.setattr(checkpoint_files.os, "fsync", real_fsync)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # no temp file either
    assert checkpoint_files.newest_good(tmp_path)[0] == paths[-1]


def test_killed_writers_temp_files_are_removed(tmp_path):
    (tmp_path / ".ckpt-00000009-0123456789abcdef.pt.77.tmp").write_bytes(b"half")
    assert checkpoint_files.remove_temp_files(tmp_path) == 1 and list(tmp_path.iterdir()) == []


def test_a_resumed_shard_skips_the_batches_already_pushed():
    sampler = datasets.ShardSampler(100, 3, 1, seed=0)
    sampler.set_epoch(4)
    whole = list(sampler)
    sampler.set_epoch(4, skip=10)
    assert list(sampler) == whole[10:] and len(sampler) == len(whole)


def test_a_data_dir_that_vanishes_mid_run_is_one_clear_error(tmp_path):
    from PIL import Image

    from app.data.datasets import DataUnavailable
    from app.training import loop

    root = tmp_path / "data"
    for c in ("a", "b"):
        (root / c).mkdir(parents=True)
        for i in range(4):
            Image.new("RGB", (8, 8), color=(i * 40, 0, 0)).save(root / c / f"{i}.png")
    config = parse(
        ["worker", "--dataset", "imagefolder", "--data_dir", str(root), "--batch_size", "2", "--world_size", "2"], {}
    )
    train = datasets.load(config.dataset, config.data_dir, "train", 0)
    sampler = datasets.ShardSampler(len(train.data), 1, 0)
    loader = datasets.train_loader(train.data, sampler, 2, 0, pin_memory=False)
    shutil.rmtree(root)
    batches = loop.resume_batches(loader, sampler, config.data_dir, 1, 0, config.epochs, config.batch_size)
    with pytest.raises(DataUnavailable, match=f"reading the data under {root} failed \\(did it vanish\\?\\)"):
        next(batches)


def test_incarnation_names_never_repeat_and_have_no_dash():
    names = [membership.incarnation_name(3, n) for n in (1, 2, 3)]
    assert names == ["worker3", "worker3_r2", "worker3_r3"] and not any("-" in n for n in names)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["ps", "--checkpoint_every", "-1"], "--checkpoint_every: -1 must be >= 0"),
        (["ps", "--join_timeout", "0"], "--join_timeout: 0.0 must be > 0"),
    ],
)
def test_failure_knobs_are_checked(argv, message):
    with pytest.raises(UsageError, match=message.replace(".", r"\.")):
        parse(argv, {})


def test_the_ps_goes_on_training_when_a_checkpoint_cannot_be_written(tmp_path, monkeypatch, caplog):

    config = parse(["ps", "--checkpoint_dir", str(tmp_path / "ck"), "--checkpoint_every", "1"], {})
    server = _server()
    with MetricsWriter(str(tmp_path / "m"), "ps", "ps", 0) as metrics:
        saver = Checkpointer(server, config, {"model_name": "cnn"}, metrics)
        push(server, 1, torch.ones(server.state.flat.size), 0)
        saver.save("every 1 updates")

        def full(*args: object) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(checkpoint_files.os, "replace", full)
        push(server, 1, torch.ones(server.state.flat.size), 1)
        with caplog.at_level(logging.WARNING, logger="app.checkpoint"):
            saver.save("every 1 updates")
    assert "checkpoint at version 2 (every 1 updates) not written: [Errno 28] No space left on device" in caplog.text
    assert [p.name[:13] for p in checkpoint_files.listing(tmp_path / "ck")] == ["ckpt-00000001"]


def _linear(size: int, value: float = 0.0) -> nn.Module:
    model = nn.Linear(size, 1, bias=False)
    nn.init.constant_(model.weight, value)
    return model


DIGITS = digits(lr=0.1, eval_every=100000, checkpoint_every=0)


def _wait_for_text(path: Path, text: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while text not in path.read_text():
        if time.monotonic() > deadline:
            pytest.fail(f"{text!r} not in {path.name} within {timeout} s:\n{path.read_text()}")
        time.sleep(0.2)


@pytest.mark.parametrize("strategy", ["sync", "ssp"])
def test_drop_answers_the_held_push_of_the_dropped_rank(strategy):
    server = ps_server(_linear(4), lr=1.0, momentum=0.0, num_trainers=2, strategy=strategy, staleness=0)
    server.join(1, "worker1")
    server.join(2, "worker2")
    future = submit(server, 2, torch.ones(4), 0, "worker2")  # ssp: one ahead of worker1, waits
    assert not future.done()
    assert server.drop(2, "worker2")
    assert future.done()
    reply = future.wait()
    assert isinstance(reply, (Reply, Refusal))


@pytest.mark.parametrize("strategy", ["sync", "ssp"])
def test_a_worker_without_a_push_for_a_set_number_of_rpc_timeouts_is_dropped(strategy, caplog):
    clock = Clock()
    server = ps_server(_linear(4), lr=1.0, momentum=0.0, num_trainers=2, clock=clock, strategy=strategy, staleness=0)
    records = []
    liveness = LivenessMonitor(server, rpc_timeout=10, record=lambda event, step, **f: records.append((event, f)))
    server.join(1, "worker1")
    server.join(2, "worker2")
    pending = submit(server, 1, torch.ones(4), 0, "worker1")  # waits for worker2
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
    server = ps_server(_linear(4), lr=1.0, momentum=0.0, num_trainers=2, clock=clock)
    liveness = LivenessMonitor(server, rpc_timeout=10, record=lambda *a, **f: None)
    server.join(2, "worker2")
    clock.now = 1000
    liveness.check_frozen()
    assert server.live_name(2) == "worker2"


@pytest.mark.slow
def test_a_replaced_incarnations_push_ends_it_with_status_2_and_one_line(tmp_path):
    common = [
        "--world_size",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        "--metrics_dir",
        str(tmp_path / "metrics"),
        "--checkpoint_dir",
        str(tmp_path / "ckpt"),
        "--rpc_timeout",
        "3",
        "--join_timeout",
        "20",
        "--num_epochs",
        "1000",
        *DIGITS,
    ]
    procs = {"ps": start_app(tmp_path, "ps", ["ps", *common])}
    try:
        _wait_for_text(tmp_path / "ps.err", "ps joined the job", 60)
        # The old process's own timeout is long: a push in flight when it is stopped must
        # not time out on resuming (that is "lost the PS", exit 1); what it meets is the
        # PS's refusal of a replaced process.
        procs["old"] = start_app(tmp_path, "old", ["worker", "--rank", "1", *common, "--rpc_timeout", "60"])
        _wait_for_text(tmp_path / "old.out", "Epoch: 1 | Batch: 10 |", 60)
        procs["old"].send_signal(signal.SIGSTOP)  # frozen: its ping times out, the PS drops it
        _wait_for_text(tmp_path / "ps.err", "dropped worker1 (rank 1)", 30)
        procs["new"] = start_app(tmp_path, "new", ["worker", "--rank", "1", *common])
        _wait_for_text(tmp_path / "ps.err", "worker1_r2 (rank 1) joined", 60)
        procs["old"].send_signal(signal.SIGCONT)  # its next push comes from a replaced process
        wait_for({"old": procs["old"]}, 30, "the replaced worker")
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    old = finished(tmp_path, "old", procs["old"])
    errors = [line for line in old.stderr.splitlines() if "error" in line.lower()]
    assert old.returncode == 2, old.stderr
    assert errors == ["app: error: worker1 was replaced by worker1_r2 for rank 1; exiting"], old.stderr
