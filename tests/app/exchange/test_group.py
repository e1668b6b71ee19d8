"""A worker or PS shard that starts before its PS listens (app.exchange.group.wait_for_ps): it
waits for the PS's port, up to --join_timeout, instead of exiting and being started again."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from app.exchange import group

from app_testkit import app_config, free_port


def _job(port: int):
    return app_config(master_addr="127.0.0.1", master_port=port)


def _listen_after(port: int, seconds: float) -> threading.Thread:
    """A listener on 127.0.0.1:`port` from `seconds` on, for a few seconds: a PS coming up late."""

    def serve() -> None:
        time.sleep(seconds)
        with socket.create_server(("127.0.0.1", port)) as server:
            server.settimeout(5)
            try:
                conn, _ = server.accept()
                conn.close()
            except TimeoutError:
                pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


def test_a_process_started_before_its_ps_waits_for_the_ps_and_goes_on_once_it_listens(monkeypatch, caplog):
    monkeypatch.setattr(group, "GIVE_UP_POLL_SECONDS", 0.2)
    port = free_port()
    listener = _listen_after(port, 1.0)
    with caplog.at_level("INFO", logger="app.membership"):
        assert group.wait_for_ps(_job(port), timeout=30, who="worker1") is True
    listener.join()
    waiting = [r.getMessage() for r in caplog.records if "waiting for the parameter server" in r.getMessage()]
    assert len(waiting) == 1 and waiting[0].startswith(f"worker1: waiting for the parameter server at 127.0.0.1:{port}")


def test_the_wait_ends_at_once_when_the_caller_gives_up(monkeypatch):
    """A worker's `given_up`: the PS's records say the run ended; it exits 0 then, not after
    the whole --join_timeout."""
    monkeypatch.setattr(group, "GIVE_UP_POLL_SECONDS", 0.2)
    asked: list[int] = []

    def ended() -> bool:
        asked.append(1)
        return len(asked) >= 3

    assert group.wait_for_ps(_job(free_port()), timeout=60, given_up=ended) is False
    assert len(asked) == 3


def test_a_ps_that_never_listens_is_a_store_unreachable_naming_the_join_timeout(monkeypatch):
    monkeypatch.setattr(group, "GIVE_UP_POLL_SECONDS", 0.2)
    port = free_port()
    with pytest.raises(group.StoreUnreachable, match=rf"at 127.0.0.1:{port} within 1 s \(--join_timeout\)"):
        group.wait_for_ps(_job(port), timeout=1.0)
