"""A worker's join when it entered the RPC group before the PS (app.worker.channels.call_joining):
RPC cannot find the PS's name until the PS enters and tells every member; the join is tried
again until then, and only for that error."""

from __future__ import annotations

import pytest

from app.worker import channels


class FakeRpc:
    """rpc_sync that fails with `errors` in turn, then answers."""

    def __init__(self, errors: list[str]) -> None:
        self.errors, self.calls = list(errors), []

    def rpc_sync(self, to, function, args, timeout):
        self.calls.append((to, function, args))
        if self.errors:
            raise RuntimeError(self.errors.pop(0))
        return {"version": 0}


def _join():  # stands for calls.rpc_join
    return None


def test_a_join_before_the_ps_entered_the_group_is_tried_again_until_the_ps_is_known(monkeypatch):
    fake = FakeRpc(["name:worker1,rank:1 could not find destination name ps"] * 2)
    monkeypatch.setattr(channels, "rpc", fake)
    assert channels.call_joining("ps", _join, (1, "worker1"), timeout=30) == {"version": 0}
    assert fake.calls == [("ps", _join, (1, "worker1"))] * 3


def test_any_other_error_of_a_join_is_not_tried_again(monkeypatch):
    fake = FakeRpc(["RPCErr:1:RPC ran for more than set timeout (60000 ms) and will now be marked with an error"])
    monkeypatch.setattr(channels, "rpc", fake)
    with pytest.raises(RuntimeError, match="timeout"):
        channels.call_joining("ps", _join, (1, "worker1"), timeout=30)
    assert len(fake.calls) == 1


def test_a_ps_that_never_enters_the_group_fails_the_join_after_the_timeout(monkeypatch):
    fake = FakeRpc(["could not find destination name ps"] * 1000)
    monkeypatch.setattr(channels, "rpc", fake)
    with pytest.raises(RuntimeError, match="could not find destination name ps"):
        channels.call_joining("ps", _join, (1, "worker1"), timeout=0.25)
    assert 1 < len(fake.calls) < 1000
