"""A job scaled while it runs: the PS's roster grows (ranks up to --max_workers join) and
shrinks (a rank leaves: nobody waits for it), under async, ssp and sync.

Unit tests drive `ParameterServer` directly, as tests/app/ps/test_strategies.py does; the
slow tests run a real PS and workers over RPC on digits, add a worker mid-run and stop one
with SIGTERM, and count the updates a job of workers of unequal speed applies: each epoch
trained once (app/ps/members/epochs.py).
"""

from __future__ import annotations

import re
import signal

import pytest
import torch
from torch import nn

from app.config import UsageError, parse
from app.exchange.wire import Share
from app.ps.members.epochs import EpochShares
from app.ps.members.roster import LEFT, LIVE, Roster
from app.ps.server import ParameterServer
from app.training.metrics import read

from app_testkit import REPO, app_env, digits, finished, free_port, ps_server, start_app, submit, wait_for


def _linear(size: int = 4) -> nn.Module:
    model = nn.Linear(size, 1, bias=False)
    nn.init.zeros_(model.weight)
    return model


def _server(strategy: str, workers: int = 2, most: int = 4, **kw) -> ParameterServer:
    server = ps_server(
        _linear(), lr=1.0, momentum=0.0, num_trainers=workers, strategy=strategy, max_trainers=most, **kw
    )
    for rank in range(1, workers + 1):
        server.join(rank, f"worker{rank}")
    return server


# --- the roster ---------------------------------------------------------------------


def test_ranks_above_the_first_ones_join_up_to_the_most_and_no_further():
    roster = Roster(range(1, 3), join_timeout=60.0, max_rank=4)
    assert sorted(roster.members) == [1, 2]  # 3 and 4 are not waited for before they join
    roster.join(1, "worker1")
    roster.join(2, "worker2")
    roster.record_push(1, 3, 7)  # rank 1 is in epoch 3, rank 2 in epoch 1 still
    roster.join(4, "worker4")
    assert roster[4].state == LIVE and sorted(roster.members) == [1, 2, 4]
    # the new rank starts at the job's next epoch: after the one the slowest live rank is in
    assert roster[4].progress()._asdict() == {"epoch": 2, "batch": 0, "pushes": 0}
    with pytest.raises(ValueError, match="rank 5 is not a worker of this job \\(ranks 1..4\\)"):
        roster.join(5, "worker5")


def test_a_rank_that_left_is_not_waited_for_and_the_run_ends_when_the_others_finish():
    roster = Roster(range(1, 4), join_timeout=60.0, max_rank=3)
    for rank in (1, 2, 3):
        roster.join(rank, f"worker{rank}")
    roster.leave(3, "worker3")
    assert roster[3].state == LEFT and roster.missing() == [] and not roster.done()
    roster.finish(1, "worker1")
    roster.finish(2, "worker2")
    assert roster.all_finished and roster.done()
    assert roster.counts() == "0 live, 2 finished, 1 left of 3"


def test_when_every_rank_left_and_none_finished_the_run_is_not_done():
    # the whole cluster stops (make down): the PS waits to be stopped or for them to come back
    roster = Roster(range(1, 3), join_timeout=0.0, max_rank=2)
    for rank in (1, 2):
        roster.join(rank, f"worker{rank}")
        roster.leave(rank, f"worker{rank}")
    assert not roster.all_finished and not roster.done()
    roster.join(1, "worker1_r2")  # it comes back
    assert roster[1].state == LIVE


def test_a_checkpoint_keeps_who_left_and_the_ranks_that_joined_later_within_its_run():
    roster = Roster(range(1, 3), join_timeout=60.0, max_rank=4)
    for rank in (1, 2, 3, 4):
        roster.join(rank, f"worker{rank}")
    roster.record_push(3, 1, 5)
    roster.leave(4, "worker4")
    saved = roster.state()
    again = Roster(range(1, 3), join_timeout=60.0, max_rank=4)
    again.restore(saved, same_run=True)
    assert again[3].progress()._asdict() == {"epoch": 1, "batch": 5, "pushes": 1} and again[4].state == LEFT
    other = Roster(range(1, 3), join_timeout=60.0, max_rank=4)
    other.restore(saved, same_run=False)  # another run: only the first ranks are its own
    assert sorted(other.members) == [1, 2]


# --- each epoch trained once --------------------------------------------------------


def _take(shares: EpochShares, rank: int, finished: Share | None, ranks=(1, 2), gone=()) -> Share | None:
    return shares.next(rank, finished, list(ranks), set(gone))


def test_a_rank_left_alone_takes_only_what_is_left_of_each_epoch():
    """worker1 trained its share of every epoch and finished while worker2 was still in epoch 1:
    worker2 then trained each later epoch whole again (a share of one: 17% more updates than
    asked). Now each share of an epoch is handed out once: worker1, faster, takes the shares
    nobody took yet, and worker2, alone, only what is left."""
    shares = EpochShares(num_epochs=3)
    first, second = _take(shares, 1, None), _take(shares, 2, None)
    assert (first, second) == (Share(1, 0, 2), Share(1, 1, 2))
    taken, done = [first, second], first
    while (done := _take(shares, 1, done)) is not None:  # worker1 is fast: it finishes first
        taken.append(done)
    done = second
    while (done := _take(shares, 2, done, ranks=(2,))) is not None:  # worker2 alone
        taken.append(done)
    handed = sorted((s.epoch, s.shard, s.num_shards) for s in taken)
    assert handed == [(e, i, 2) for e in (1, 2, 3) for i in (0, 1)]  # every share of every epoch, once


def test_a_faster_rank_takes_the_shares_nobody_took_yet():
    shares = EpochShares(num_epochs=2)
    a = _take(shares, 1, None)
    b = _take(shares, 1, a)  # worker2 has not asked yet: worker1 takes the other share of epoch 1
    assert (a, b) == (Share(1, 0, 2), Share(1, 1, 2))
    assert _take(shares, 2, None) == Share(2, 1, 2)  # epoch 2, split between the two


def test_the_share_of_a_rank_that_left_goes_on_from_where_it_stopped_and_a_restart_resumes_its_own():
    shares = EpochShares(num_epochs=1)
    own, other = _take(shares, 1, None, ranks=(1, 2, 3)), _take(shares, 3, None, ranks=(1, 2, 3))
    assert (own, other) == (Share(1, 0, 3), Share(1, 2, 3))  # each its place among the three
    shares.record(1, 1, 4)
    shares.record(3, 1, 7)  # worker3 trained 7 batches of its share, then left
    shares.release(3)
    assert _take(shares, 1, None, ranks=(1, 2)) == own._replace(skip=4)  # a new process of rank 1
    assert _take(shares, 2, None) == Share(1, 1, 3)  # the share nobody took yet comes first
    assert _take(shares, 1, own) == other._replace(skip=7)
    assert _take(shares, 2, Share(1, 1, 3)) is None and _take(shares, 1, other._replace(skip=7)) is None


def test_a_missing_ranks_share_is_taken_over():
    shares = EpochShares(num_epochs=1)
    _take(shares, 1, None)
    dropped = _take(shares, 2, None)
    shares.record(2, 1, 3)
    assert _take(shares, 1, Share(1, 0, 2), gone={2}) == dropped._replace(skip=3)
    assert _take(shares, 2, None) is None  # rank 2 back after all: its share is rank 1's now


def test_the_epochs_shares_are_in_the_ps_checkpoint_of_a_job_that_may_be_scaled():
    server = _server("async", workers=2, most=3)
    assert "epochs" not in server.checkpoint()  # nothing asked: a job's final.pt as before
    first = server.share(1)
    submit(server, 1, torch.ones(4), 0, epoch=1, batch=1).wait()
    saved = server.checkpoint()
    restarted = _server("async", workers=2, most=3)
    restarted.restore(saved)
    assert restarted.share(1) == first._replace(skip=1) and restarted.share(2) == Share(1, 1, 2)


# --- async, ssp, sync ---------------------------------------------------------------


def test_async_takes_a_new_rank_at_once_and_lets_one_leave():
    server = _server("async")
    server.join(3, "worker3")
    assert submit(server, 3, torch.ones(4), 0).wait().version == 1
    assert server.share(3) == Share(1, 2, 3) and server.live_count() == 3  # epoch 1 among three
    assert server.leave(3, pushes=1, name="worker3") is None
    assert server.live_count() == 2 and server.share(1) == Share(1, 0, 3)


def test_a_push_that_lands_after_its_worker_left_is_refused_and_the_run_still_ends():
    """A push still on the wire when its worker left (SIGTERM) used to readmit the worker as
    live: the PS then waited for a process that had exited, and the run did not end."""
    server = _server("async")
    submit(server, 1, torch.ones(4), 0).wait()
    assert server.leave(1, pushes=1, name="worker1") is None
    state = server.state.vector.clone()
    late = submit(server, 1, torch.ones(4), 1, name="worker1").wait()
    assert late.kind == "stale" and "worker1 left the job" in late.message
    assert server.live_count() == 1 and torch.equal(server.state.vector, state)  # not back, not applied
    server.finish(2, pushes=0)
    assert server.done() and server.all_finished


def test_ssp_bound_follows_the_live_set():
    server = _server("ssp", workers=2, staleness=1)
    server.join(3, "worker3")  # a new rank: ssp counts it at once
    assert submit(server, 1, torch.ones(4), 0).wait().lead == 1
    held = submit(server, 1, torch.ones(4), 1)  # 2 ahead of worker2 and worker3: waits
    assert not held.done()
    submit(server, 2, torch.ones(4), 0).wait()
    assert not held.done()  # worker3 is still the slowest
    server.leave(3, pushes=0, name="worker3")  # it leaves: the bound is taken over ranks 1 and 2
    assert held.wait().lead == 1


def test_sync_counts_a_rank_that_joins_mid_round_from_the_next_round():
    server = _server("sync", workers=2)
    first = submit(server, 1, torch.full((4,), 2.0), 0)
    server.join(3, "worker3")  # mid-round: this round does not wait for it
    second = submit(server, 2, torch.full((4,), 4.0), 0)
    assert first.wait().version == 1 and second.wait().version == 1
    assert torch.equal(second.wait().vector, torch.full((4,), -3.0))  # the mean of ranks 1 and 2 only
    # the next round waits for rank 3 too
    a, b = submit(server, 1, torch.ones(4), 1), submit(server, 2, torch.ones(4), 1)
    assert not a.done() and not b.done()
    c = submit(server, 3, torch.full((4,), 4.0), 1)
    assert c.wait().version == 2 and a.done() and b.done()
    assert torch.equal(c.wait().vector, torch.full((4,), -5.0))  # -3 - mean(1, 1, 4)


def test_sync_round_shrinks_when_a_rank_leaves():
    server = _server("sync", workers=3, most=3)
    first = submit(server, 1, torch.full((4,), 1.0), 0)
    second = submit(server, 2, torch.full((4,), 3.0), 0)
    assert not first.done()
    server.leave(3, pushes=0, name="worker3")
    assert first.wait().version == 1 and torch.equal(second.wait().vector, torch.full((4,), -2.0))
    assert not server.done()
    server.finish(1, pushes=1)
    server.finish(2, pushes=1)
    assert server.done() and server.all_finished


def test_a_leave_from_a_replaced_process_is_refused():
    server = _server("async")
    server.join(2, "worker2_r2")
    refusal = server.leave(2, pushes=0, name="worker2")
    assert refusal is not None and refusal.kind == "stale"


def test_max_workers_bounds_a_workers_rank():
    config = parse(["worker", "--rank", "4", "--world_size", "3", "--max_workers", "4"], {})
    assert config.max_trainers == 4 and config.num_trainers == 2
    with pytest.raises(UsageError, match="--rank: 5 must be in 1..4"):
        parse(["worker", "--rank", "5", "--world_size", "3", "--max_workers", "4"], {})
    with pytest.raises(UsageError, match="--max_workers: got 4; strategy allreduce has a fixed world size"):
        parse(["worker", "--strategy", "allreduce", "--world_size", "3", "--max_workers", "4"], {})


# --- real processes ---------------------------------------------------------------


def _records(path, event: str) -> list[dict]:
    return [r for r in read(path) if r["event"] == event] if path.exists() else []


def _until(what: str, check, timeout: float = 90.0):
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.2)
    pytest.fail(f"{what}: not within {timeout:.0f} s")


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["async", "sync"])
def test_a_worker_added_mid_run_joins_then_leaves_on_sigterm_and_the_run_ends_0(tmp_path, strategy):
    metrics = tmp_path / "metrics"
    common = [
        *("--world_size", "3", "--max_workers", "3", "--strategy", strategy),
        *("--master_addr", "127.0.0.1", "--master_port", str(free_port())),
        *("--metrics_dir", str(metrics), "--checkpoint_dir", str(tmp_path / "checkpoints")),
        # 40 epochs: worker3 joined and left by epoch 9-12 on a quiet 2-core CPU VM (with 100, ~88%
        # of the run came after what this test checks)
        *digits(lr=0.05, num_epochs=40),
        *("--rpc_timeout", "30", "--seed", "3", "--log_every", "1", "--eval_every", "500"),
    ]
    procs = {"ps": start_app(tmp_path, "ps", ["ps", *common])}
    try:
        for rank in (1, 2):
            procs[f"worker{rank}"] = start_app(tmp_path, f"worker{rank}", ["worker", "--rank", str(rank), *common])
        _until("both workers train", lambda: len(_records(metrics / "worker2.jsonl", "train")) > 3)
        procs["worker3"] = start_app(tmp_path, "worker3", ["worker", "--rank", "3", *common])  # scaled up
        _until("worker3 trains", lambda: len(_records(metrics / "worker3.jsonl", "train")) > 3)
        procs["worker3"].send_signal(signal.SIGTERM)  # scaled down again: the highest rank leaves
        wait_for(procs, 240)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    ended = {name: finished(tmp_path, name, proc) for name, proc in procs.items()}
    for p in ended.values():
        assert p.returncode == 0, f"{p.name} exited {p.returncode}:\n{p.stderr}"
    ps = metrics / "ps.jsonl"
    joins = {r["worker"]: r for r in _records(ps, "join")}
    left = _records(ps, "left")
    assert joins["worker3"]["workers"] == 3 and joins["worker3"]["step"] > 0  # joined the running job
    assert joins["worker3"]["epoch"] > 1  # at the job's next epoch, not from the start
    assert [r["worker"] for r in left] == ["worker3"] and left[0]["workers"] == 2
    assert left[0]["step"] > joins["worker3"]["step"]
    assert _records(ps, "drop") == []  # a leave is not a failure
    assert _records(metrics / "worker3.jsonl", "left")
    end = _records(ps, "end")[-1]
    assert end["pushes"]["worker3"] > 0 and end["accuracy"] >= 0.85


@pytest.mark.slow
def test_a_worker_that_starts_after_the_run_ended_exits_0_with_one_line(tmp_path):
    """`make scale` just before the end: the new ranks found no PS and failed (exit 1, then
    `cannot reach the parameter server ... cannot resolve ps`), restarted by compose for ever.
    worker2 starts while the run trains but cannot reach the PS (its address is gone, as a PS
    container that exited): it waits for the PS (--join_timeout) and, once the PS's records say
    the run ended, stops waiting. worker3 starts once the PS has exited: it reads that at once."""
    metrics = tmp_path / "metrics"
    port = free_port()
    common = [
        *("--world_size", "2", "--max_workers", "3", "--run_id", "late-run"),
        *("--master_addr", "127.0.0.1", "--metrics_dir", str(metrics), "--checkpoint_dir", str(tmp_path / "ck")),
        *digits(num_epochs=2, seed=3),
    ]
    procs = {
        "ps": start_app(tmp_path, "ps", ["ps", *common, "--master_port", str(port)]),
        "worker1": start_app(tmp_path, "worker1", ["worker", "--rank", "1", *common, "--master_port", str(port)]),
        # nothing listens on its port: it waits for the PS, as for a name that no longer resolves
        "worker2": start_app(
            tmp_path, "worker2", ["worker", "--rank", "2", *common, "--master_port", str(free_port())]
        ),
    }
    wait_for({"ps": procs["ps"], "worker1": procs["worker1"]}, 120, "the run")
    procs["worker3"] = start_app(tmp_path, "worker3", ["worker", "--rank", "3", *common, "--master_port", str(port)])
    wait_for(procs, 90)
    ended = {name: finished(tmp_path, name, proc) for name, proc in procs.items()}
    assert {n: p.returncode for n, p in ended.items()} == dict.fromkeys(procs, 0), {
        n: p.stderr[-600:] for n, p in ended.items()
    }
    version = _records(metrics / "ps.jsonl", "end")[-1]["step"]
    for name in ("worker2", "worker3"):
        lines = [line for line in ended[name].stderr.splitlines() if "already ended" in line]
        assert len(lines) == 1 and lines[0].endswith(
            f"{name}: run late-run already ended at version {version} (the PS's records in {metrics}); nothing to do"
        ), ended[name].stderr
    assert "failed" not in ended["worker3"].stderr and not _records(metrics / "worker3.jsonl", "start")


@pytest.mark.slow
def test_with_the_file_cache_a_scaled_up_worker_follows_the_live_sets_share(tmp_path):
    """The file image cache gave each worker a stable shard for the whole run: worker3, added
    above the first two, kept 1/3 of the images, and the others their 1/2, whoever trained.
    Now the file holds the whole split (one file, written once, mapped by every worker) and
    each epoch's shares follow the live set: with worker1 gone, worker3 takes shares of 2."""
    from PIL import Image

    root = tmp_path / "data"
    for c, colour in enumerate(((250, 0, 0), (0, 0, 250))):
        (root / f"c{c}").mkdir(parents=True)
        for i in range(40):
            Image.new("RGB", (20, 16), tuple(max(0, v - i) for v in colour)).save(root / f"c{c}" / f"{i:02d}.png")
    metrics, cache = tmp_path / "metrics", tmp_path / "cache"
    common = [
        *("--world_size", "3", "--max_workers", "3", "--run_id", "file-cache-run"),
        *("--master_addr", "127.0.0.1", "--master_port", str(free_port())),
        *("--metrics_dir", str(metrics), "--checkpoint_dir", str(tmp_path / "ck"), "--cache_dir", str(cache)),
        *("--model", "cnn", "--dataset", "imagefolder", "--data_dir", str(root), "--image_size", "16"),
        *("--image_cache", "file", "--loader_workers", "0", "--batch_size", "4", "--num_epochs", "80"),
        *("--rpc_timeout", "30", "--seed", "3", "--log_every", "1", "--eval_every", "100000"),
    ]
    procs = {"ps": start_app(tmp_path, "ps", ["ps", *common])}
    try:
        for rank in (1, 2):
            procs[f"worker{rank}"] = start_app(tmp_path, f"worker{rank}", ["worker", "--rank", str(rank), *common])
        _until("both workers train", lambda: len(_records(metrics / "worker2.jsonl", "train")) > 3)
        procs["worker3"] = start_app(tmp_path, "worker3", ["worker", "--rank", "3", *common])  # scaled up
        _until("worker3 trains", lambda: len(_records(metrics / "worker3.jsonl", "train")) > 3)
        # an epoch of worker2's begins with three live (on a loaded host it may take a while)
        _until("worker2 takes a share of three", lambda: re.search(r"share \d of 3\b", _err(tmp_path, "worker2")))
        procs["worker1"].send_signal(signal.SIGTERM)  # scaled down: worker1 leaves
        _until("worker3 takes a share of two", lambda: re.search(r"share \d of 2\b", _err(tmp_path, "worker3")))
        wait_for(procs, 240)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    ended = {name: finished(tmp_path, name, proc) for name, proc in procs.items()}
    assert {n: p.returncode for n, p in ended.items()} == dict.fromkeys(procs, 0), {
        n: p.stderr[-600:] for n, p in ended.items()
    }
    assert re.search(r"share \d of 3\b", ended["worker2"].stderr)  # the first ones follow too
    files = sorted(p.name.split("-")[2] for p in cache.glob("*.u8"))  # images-16px-<count>-<hash>.u8
    assert files == ["72", "8"], files  # the whole train split (72 of 80 images) and the PS's held-out 8
    assert sorted(p.name for p in cache.iterdir()) == sorted(p.name for p in cache.glob("*.u8"))  # no lock left


def _err(tmp_path, name: str) -> str:
    path = tmp_path / f"{name}.err"
    return path.read_text() if path.exists() else ""


# --- each epoch trained once, as processes ----------------------------------------------

# A model whose training step takes SLOW_STEP_S seconds more in the process that has it set: a
# worker slower than the others, as a cluster's mixed cards make one (the user's own model,
# app/plugins.py; the PS evaluates it in eval mode, unslowed).
SLOW_MODEL = """
import os, time
from torch import nn
from app.training.models import SmallCNN

class Slowed(nn.Module):
    def __init__(self, channels, num_classes):
        super().__init__()
        self.inner = SmallCNN(channels, num_classes)
        self.pause = float(os.environ.get("SLOW_STEP_S", "0"))

    def forward(self, x):
        if self.training and self.pause:
            time.sleep(self.pause)
        return self.inner(x)

def build(num_classes, channels):
    return Slowed(channels, num_classes)
"""
EPOCHS = 6
BATCHES = 84  # digits' 1,438 training images in batches of 17: 84 an epoch, cut into 1 to 4 shares alike


def _unequal_job(tmp_path, most: int | None, epochs: int = EPOCHS) -> tuple[list[str], dict[str, str]]:
    """The flags of a digits job of two workers (up to `most`) and `epochs` epochs, and the
    environment its processes share (`slowed`: that environment, a step slower by s seconds)."""
    code = tmp_path / "code"
    code.mkdir()
    (code / "slowed.py").write_text(SLOW_MODEL)
    env = app_env()
    env["PYTHONPATH"] = f"{REPO}:{code}"
    common = [
        *("--world_size", "3", "--strategy", "async"),
        *(("--max_workers", str(most)) if most else ()),
        *("--master_addr", "127.0.0.1", "--master_port", str(free_port())),
        *("--metrics_dir", str(tmp_path / "metrics"), "--checkpoint_dir", str(tmp_path / "checkpoints")),
        *("--model", "slowed:build", "--dataset", "digits", "--batch_size", "17", "--lr", "0.05"),
        *("--num_epochs", str(epochs), "--rpc_timeout", "30", "--seed", "3", "--log_every", "1"),
        *("--eval_every", "100000"),
    ]
    return common, env


def slowed(env: dict[str, str], seconds: float) -> dict[str, str]:
    return {**env, "SLOW_STEP_S": str(seconds)}


def _applied(tmp_path, procs: dict) -> int:
    """Every process exited 0: the updates the PS applied (its `end` record)."""
    ended = {name: finished(tmp_path, name, proc) for name, proc in procs.items()}
    assert {n: p.returncode for n, p in ended.items()} == dict.fromkeys(procs, 0), {
        n: p.stderr[-800:] for n, p in ended.items()
    }
    end = _records(tmp_path / "metrics" / "ps.jsonl", "end")[-1]
    assert sum(end["pushes"].values()) == end["step"]  # async: one update a push
    return end["step"]


@pytest.mark.slow
@pytest.mark.parametrize("most", [3, None], ids=["max_workers", "fixed"])
def test_workers_of_unequal_speed_train_each_epoch_once(tmp_path, most):
    """worker2 is slower: worker1 finishes first. With --max_workers, worker2, alone, trained
    every epoch it had left whole again (cpu-smoke with max 4: 1,540 updates where 1,320 were
    asked). The updates applied are the job's epochs x an epoch's batches, with a fixed shard
    each (no --max_workers) as with shares handed out by the PS."""
    common, env = _unequal_job(tmp_path, most)
    procs = {"ps": start_app(tmp_path, "ps", ["ps", *common], env)}
    procs["worker1"] = start_app(tmp_path, "worker1", ["worker", "--rank", "1", *common], env)
    procs["worker2"] = start_app(tmp_path, "worker2", ["worker", "--rank", "2", *common], slowed(env, 0.04))
    wait_for(procs, 420)
    applied = _applied(tmp_path, procs)
    assert abs(applied - EPOCHS * BATCHES) <= 2, f"{applied} updates applied; {EPOCHS} x {BATCHES} asked"


@pytest.mark.slow
def test_each_epoch_is_trained_once_across_a_scale_up_and_down(tmp_path):
    """worker2 three times as slow as worker1, worker3 added mid-run, then scaled down again
    (SIGTERM) in the middle of a share: what it left of that share is trained by another, from
    where it stopped."""
    epochs = 2 * EPOCHS  # every step slowed: long enough for worker3 to start, join and train
    common, env = _unequal_job(tmp_path, 3, epochs)
    metrics = tmp_path / "metrics"
    procs = {"ps": start_app(tmp_path, "ps", ["ps", *common], env)}
    try:
        procs["worker1"] = start_app(tmp_path, "worker1", ["worker", "--rank", "1", *common], slowed(env, 0.03))
        procs["worker2"] = start_app(tmp_path, "worker2", ["worker", "--rank", "2", *common], slowed(env, 0.1))
        _until("both workers train", lambda: len(_records(metrics / "worker2.jsonl", "train")) > 0, 180)
        worker3 = ["worker", "--rank", "3", *common]
        procs["worker3"] = start_app(tmp_path, "worker3", worker3, slowed(env, 0.03))  # scaled up
        _until("worker3 trains", lambda: len(_records(metrics / "worker3.jsonl", "train")) > 10, 180)
        procs["worker3"].send_signal(signal.SIGTERM)  # scaled down: it leaves mid-share
        wait_for(procs, 420)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    applied = _applied(tmp_path, procs)
    assert [r["worker"] for r in _records(metrics / "ps.jsonl", "left")] == ["worker3"]
    assert abs(applied - epochs * BATCHES) <= 3, f"{applied} updates applied; {epochs} x {BATCHES} asked"
