"""A worker's join when it entered the RPC group before the PS (app.worker.channels.call_joining):
RPC cannot find the PS's name until the PS enters and tells every member; the join is tried
again until then, and only for that error."""

from __future__ import annotations

import time

import pytest

from app.worker import channels

import app_testkit as testkit


class FakeTransport:
    """app.exchange.transport's `call` that fails with `errors` in turn, then answers."""

    def __init__(self, errors: list[str]) -> None:
        self.errors, self.calls = list(errors), []

    def call(self, to, function, args=(), timeout=-1):
        self.calls.append((to, function, args))
        if self.errors:
            raise RuntimeError(self.errors.pop(0))
        return {"version": 0}


WAITING = "waiting for the parameter server at 127.0.0.1:"


def _join():  # stands for calls.rpc_join
    return None


def test_a_join_before_the_ps_entered_the_group_is_tried_again_until_the_ps_is_known(monkeypatch):
    fake = FakeTransport(["name:worker1,rank:1 could not find destination name ps"] * 2)
    monkeypatch.setattr(channels, "transport", fake)
    assert channels.call_joining("ps", _join, (1, "worker1"), timeout=30) == {"version": 0}
    assert fake.calls == [("ps", _join, (1, "worker1"))] * 3


def test_any_other_error_of_a_join_is_not_tried_again(monkeypatch):
    fake = FakeTransport(["RPCErr:1:RPC ran for more than set timeout (60000 ms) and will now be marked with an error"])
    monkeypatch.setattr(channels, "transport", fake)
    with pytest.raises(RuntimeError, match="timeout"):
        channels.call_joining("ps", _join, (1, "worker1"), timeout=30)
    assert len(fake.calls) == 1


def test_a_ps_that_never_enters_the_group_fails_the_join_after_the_timeout(monkeypatch):
    fake = FakeTransport(["could not find destination name ps"] * 1000)
    monkeypatch.setattr(channels, "transport", fake)
    with pytest.raises(RuntimeError, match="could not find destination name ps"):
        channels.call_joining("ps", _join, (1, "worker1"), timeout=0.25)
    assert 1 < len(fake.calls) < 1000


@pytest.mark.slow
def test_workers_and_a_shard_started_before_their_ps_wait_for_it_and_the_run_ends_0(tmp_path):
    """A PS restarted beside its workers, or one slow to start on a loaded host: the workers and
    the shard wait for its port (--join_timeout), not --rpc_timeout, and train once it listens.
    The PS starts once each waits, and 3 of their --rpc_timeout later: each used to end a waiting process."""
    common = [
        *testkit.job_args(tmp_path, 3),
        *testkit.DIGITS,
        *("--num_epochs", "3", "--shards", "2", "--rpc_timeout", "4", "--join_timeout", "120"),
    ]
    procs = {
        "ps1": testkit.start_app(tmp_path, "ps1", ["ps", "--shard", "1", *common]),
        "worker1": testkit.start_app(tmp_path, "worker1", ["worker", "--rank", "1", *common]),
        "worker2": testkit.start_app(tmp_path, "worker2", ["worker", "--rank", "2", *common]),
    }
    try:  # each waits, however long its start takes on a loaded host; then 3 of its --rpc_timeout pass
        deadline = time.monotonic() + 180
        while not all(WAITING in (tmp_path / f"{name}.err").read_text() for name in procs):
            assert all(p.poll() is None for p in procs.values()), {n: p.poll() for n, p in procs.items()}
            assert time.monotonic() < deadline, {n: (tmp_path / f"{n}.err").read_text()[-800:] for n in procs}
            time.sleep(0.5)
        time.sleep(12)
        assert all(p.poll() is None for p in procs.values()), {n: p.poll() for n, p in procs.items()}
    except BaseException:
        for proc in procs.values():
            proc.kill()
            proc.wait()
        raise
    procs["ps"] = testkit.start_app(tmp_path, "ps", ["ps", *common])
    testkit.wait_for(procs, 240, "the run started after its workers")

    ended = {name: testkit.finished(tmp_path, name, proc) for name, proc in procs.items()}
    assert {n: p.returncode for n, p in ended.items()} == {"ps1": 0, "worker1": 0, "worker2": 0, "ps": 0}, {
        n: p.stderr[-2000:] for n, p in ended.items()
    }
    for name in ("ps1", "worker1", "worker2"):
        assert ended[name].stderr.count(WAITING) == 1, ended[name].stderr
    assert testkit.final_accuracy(ended["ps"].stdout) >= 0.85
