"""A worker that ends cleanly before it joined is not waited for: a scale down of a rank not
joined yet (SIGTERM), or the user's code exiting 0 as it builds the model. Before, the PS
waited --join_timeout for the rank (4 min 35 s in a compose run, then "ending without rank 2").
The process says so in the PS's store (app.exchange.group.say_not_joining) and the PS takes
the rank as left (app.ps.members.liveness). A rank merely slow to join is still waited for:
only a note in the store, and only for a rank not live, ends the wait.

The slow tests run a real PS and workers on 127.0.0.1; worker2's model (the user's code, in a
module of the test's own) marks that it is being built, then blocks or exits 0.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from app.exchange import group
from app.ps.members.roster import ABSENT, FINISHED, LEFT, LIVE, Roster
from app.training.metrics import read

from app_testkit import REPO, app_config, app_env, digits, finished, free_port, secret_file, start_app, wait_for

PLUGIN = """
import os, sys, threading
from pathlib import Path

def build(num_classes, channels):
    Path(os.environ["BUILDING_MARK"]).write_text("building")
    if os.environ["AT_BUILD"] == "exit0":
        sys.exit(0)
    threading.Event().wait()  # held until SIGTERM (a scale down of a rank not joined yet)
"""


def test_a_rank_not_joined_is_taken_as_left_and_no_other():
    roster = Roster([1, 2, 3, 4], join_timeout=600.0)
    roster.join(1, "worker1")
    roster.join(3, "worker3")
    roster.finish(3, "worker3")
    roster.join(4, "worker4")
    roster.drop(4, "worker4")
    assert [roster.withdraw(r) for r in (1, 2, 3, 4, 9)] == [False, True, False, True, False]
    assert {r: m.state for r, m in roster.members.items()} == {1: LIVE, 2: LEFT, 3: FINISHED, 4: LEFT}
    assert not roster.done()  # rank 1 still trains
    roster.finish(1, "worker1")
    assert roster.done()
    roster.join(2, "worker2")  # a new process of a rank that said it would not join: it trains
    assert roster.members[2].state == LIVE and not roster.done()
    assert {m.state for m in Roster([1], join_timeout=600.0).members.values()} == {ABSENT}


def test_a_note_in_the_store_counts_once_and_only_for_its_rank(tmp_path):
    from app.exchange import transport

    job = dict(master_addr="127.0.0.1", master_port=free_port(), secret_file=secret_file(tmp_path))
    with transport.session(app_config("ps", **job), rank=0):  # the main PS's own store, in its session
        store = transport.own_store(app_config("ps", **job), 30)
        assert group.not_joining(store, [1, 2, 3]) == []
        assert group.say_not_joining(app_config("worker", rank=2, **job))
        assert group.not_joining(store, [1, 2, 3]) == [2]
        assert group.not_joining(store, [1, 2, 3]) == []  # taken off as read
    gone = app_config("worker", rank=2, **{**job, "master_port": free_port()})
    assert not group.say_not_joining(gone, timeout=0.5)  # no PS: False, at once


def _records(path: Path, event: str) -> list[dict]:
    return [r for r in read(path) if r["event"] == event] if path.exists() else []


def _until(what: str, check, deadline_s: float = 120.0) -> None:
    """Wait for `check()`; the deadline only turns a hang into a failure."""
    deadline = time.monotonic() + deadline_s
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {deadline_s:.0f} s")
        time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.parametrize("at_build", ["sigterm", "exit0"])
def test_a_worker_that_ends_cleanly_before_it_joined_is_not_waited_for(tmp_path, at_build):
    metrics = tmp_path / "metrics"
    code = tmp_path / "code"
    code.mkdir()
    (code / "holds.py").write_text(PLUGIN)
    mark = tmp_path / "building"
    common = [
        *("--world_size", "3", "--master_addr", "127.0.0.1", "--master_port", str(free_port())),
        *("--metrics_dir", str(metrics), "--checkpoint_dir", str(tmp_path / "checkpoints")),
        *("--join_timeout", "600", "--run_id", "not-joining"),  # far past the deadline below
    ]
    job = digits(lr=0.1, num_epochs=3, seed=1)
    env = {**app_env(), "PYTHONPATH": f"{REPO}:{code}", "BUILDING_MARK": str(mark), "AT_BUILD": at_build}
    procs = {"ps": start_app(tmp_path, "ps", ["ps", *common, *job])}
    try:
        procs["worker1"] = start_app(tmp_path, "worker1", ["worker", "--rank", "1", *common, *job])
        _until("worker1 joins", lambda: _records(metrics / "ps.jsonl", "join"))  # the PS listens
        worker2 = ["worker", "--rank", "2", *common, *digits(lr=0.1, num_epochs=3, model="holds:build")]
        procs["worker2"] = start_app(tmp_path, "worker2", worker2, env, fork=False)
        _until("worker2 builds its model", mark.exists)
        if at_build == "sigterm":
            procs["worker2"].send_signal(signal.SIGTERM)  # scaled down before it joined
        wait_for(procs, 240, "the run (the PS waiting --join_timeout 600 s for rank 2?)")
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    ended = {name: finished(tmp_path, name, proc) for name, proc in procs.items()}
    assert {n: p.returncode for n, p in ended.items()} == dict.fromkeys(procs, 0), {
        n: p.stderr[-800:] for n, p in ended.items()
    }
    ps = metrics / "ps.jsonl"
    assert [(r["worker"], r["joined"]) for r in _records(ps, "left")] == [("worker2", False)]
    assert [r["worker"] for r in _records(ps, "join")] == ["worker1"]
    assert "rank 2 left before it joined: its process ended cleanly" in ended["ps"].stderr
    assert "ending without" not in ended["ps"].stderr
    assert _records(ps, "end") and _records(metrics / "worker1.jsonl", "end")


ENDS_MID_RUN = """
import sys
from app.training.models import SmallCNN

class EndsAtItsFifthBatch(SmallCNN):
    calls = 0

    def forward(self, x):
        EndsAtItsFifthBatch.calls += 1
        if EndsAtItsFifthBatch.calls == 5:
            sys.exit(3)
        return super().forward(x)

def build(num_classes, channels):
    return EndsAtItsFifthBatch(channels=channels, num_classes=num_classes)
"""


@pytest.mark.slow
def test_the_users_code_ending_a_joined_worker_keeps_its_exit_status(tmp_path):
    """A SystemExit from the user's code mid-run is not a scale down: the worker exits with the
    status the code gave, and does not tell the PS it left (before: "left the job", exit 0)."""
    metrics = tmp_path / "metrics"
    code = tmp_path / "code"
    code.mkdir()
    (code / "ends.py").write_text(ENDS_MID_RUN)
    common = [
        *("--world_size", "2", "--master_addr", "127.0.0.1", "--master_port", str(free_port())),
        *("--metrics_dir", str(metrics), "--checkpoint_dir", str(tmp_path / "checkpoints")),
        *("--run_id", "ends-mid-run"),
    ]
    env = {**app_env(), "PYTHONPATH": f"{REPO}:{code}"}
    procs = {"ps": start_app(tmp_path, "ps", ["ps", *common, *digits(lr=0.1, num_epochs=3)])}
    try:
        worker = ["worker", "--rank", "1", *common, *digits(lr=0.1, num_epochs=3, model="ends:build")]
        procs["worker1"] = start_app(tmp_path, "worker1", worker, env, fork=False)
        procs["worker1"].wait(timeout=240)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    ended = finished(tmp_path, "worker1", procs["worker1"])
    assert ended.returncode == 3, ended.stderr[-800:]
    assert "left the job" not in ended.stderr and not _records(metrics / "ps.jsonl", "left")
