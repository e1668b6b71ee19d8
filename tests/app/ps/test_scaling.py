"""A job scaled while it runs: the PS's roster grows (ranks up to --max_workers join) and
shrinks (a rank leaves: nobody waits for it), under async, ssp and sync.

Unit tests drive `ParameterServer` directly, as tests/app/ps/test_strategies.py does; the
slow test runs a real PS and workers over RPC on digits, adds a worker mid-run and
stops one with SIGTERM.
"""

from __future__ import annotations

import signal

import pytest
import torch
from torch import nn

from app.config import UsageError, parse
from app.ps.members.roster import LEFT, LIVE, Roster
from app.ps.server import ParameterServer
from app.training.metrics import read

from app_testkit import finished, free_port, ps_server, start_app, submit, wait_for


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


# --- async, ssp, sync ---------------------------------------------------------------


def test_async_takes_a_new_rank_at_once_and_lets_one_leave():
    server = _server("async")
    server.join(3, "worker3")
    assert submit(server, 3, torch.ones(4), 0).wait().version == 1
    assert server.share(3) == (2, 3) and server.live_count() == 3
    assert server.leave(3, pushes=1, name="worker3") is None
    assert server.live_count() == 2 and server.share(1) == (0, 2)


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
        *("--model", "cnn", "--dataset", "digits", "--batch_size", "32", "--lr", "0.05", "--num_epochs", "100"),
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
    container that exited): when that wait fails, the PS's records say the run ended. worker3
    starts once the PS has exited: it reads that at once."""
    metrics = tmp_path / "metrics"
    port = free_port()
    common = [
        *("--world_size", "2", "--max_workers", "3", "--run_id", "late-run"),
        *("--master_addr", "127.0.0.1", "--metrics_dir", str(metrics), "--checkpoint_dir", str(tmp_path / "ck")),
        *("--model", "cnn", "--dataset", "digits", "--batch_size", "32", "--num_epochs", "2", "--seed", "3"),
    ]
    procs = {
        "ps": start_app(tmp_path, "ps", ["ps", *common, "--master_port", str(port)]),
        "worker1": start_app(tmp_path, "worker1", ["worker", "--rank", "1", *common, "--master_port", str(port)]),
        # nothing listens on its port: it waits --rpc_timeout for the PS, as for a name that no longer resolves
        "worker2": start_app(
            tmp_path,
            "worker2",
            ["worker", "--rank", "2", *common, "--master_port", str(free_port())] + ["--rpc_timeout", "40"],
        ),
    }
    wait_for({"ps": procs["ps"], "worker1": procs["worker1"]}, 120, "the run")
    assert procs["worker2"].poll() is None  # still waiting for the PS when the run ended
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
    each epoch's share follows the live set: with worker1 gone, worker3 takes 1 of 2."""
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
        procs["worker1"].send_signal(signal.SIGTERM)  # scaled down: worker1 leaves
        _until("worker3 takes its share of two", lambda: "shared by 2 workers; share 1" in _err(tmp_path, "worker3"))
        wait_for(procs, 240)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    ended = {name: finished(tmp_path, name, proc) for name, proc in procs.items()}
    assert {n: p.returncode for n, p in ended.items()} == dict.fromkeys(procs, 0), {
        n: p.stderr[-600:] for n, p in ended.items()
    }
    assert "shared by 3 workers" in ended["worker2"].stderr  # the first ones follow too
    files = sorted(p.name.split("-")[2] for p in cache.glob("*.u8"))  # images-16px-<count>-<hash>.u8
    assert files == ["72", "8"], files  # the whole train split (72 of 80 images) and the PS's held-out 8
    assert sorted(p.name for p in cache.iterdir()) == sorted(p.name for p in cache.glob("*.u8"))  # no lock left


def _err(tmp_path, name: str) -> str:
    path = tmp_path / f"{name}.err"
    return path.read_text() if path.exists() else ""
