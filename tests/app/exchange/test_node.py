"""The job's own transport (app.exchange.node): calls by name over ZeroMQ that prove the run's
secret before anything is read, answers held as futures, peers that are gone found out at once,
and what is not a message of the job dropped while the job goes on."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import zmq
from torch.futures import Future

from app.exchange import node as node_module
from app.exchange import secret, transport
from app.exchange.node import Node
from app.exchange.sockets import Mechanism
from app.exchange.store import Store
from app.exchange.wire import Push, Reply

from app_testkit import REPO, app_env, free_port

CREDENTIALS = secret.derive(b"0123456789abcdef" * 4)
OTHER = secret.derive(b"fedcba9876543210" * 4)
RAN: list[str] = []
HELD: list[Future] = []


@transport.served
def scaled(vector: torch.Tensor, push: Push) -> Reply:
    RAN.append("scaled")
    return Reply(vector * 2, push.pulled + 1, 0, 0)


@transport.answered_later
def held() -> Future:
    future: Future = Future()
    HELD.append(future)
    return future


THREADS: list[str] = []


@transport.at_once(lambda vector, push: push.finite)
def stepped(vector: torch.Tensor, push: Push) -> Reply:
    """Answered on the I/O thread for a push that says finite, by a pool thread otherwise."""
    THREADS.append(threading.current_thread().name)
    return Reply(vector + 1, push.pulled + 1, 0, 0)


@transport.at_once(lambda: True)
@transport.answered_later
def held_at_once() -> Future:
    future: Future = Future()
    HELD.append(future)
    return future


AFTER: list[threading.Event] = []  # the work left for after a reply waits for the caller to have it


@transport.at_once(lambda at_once: at_once)
def answered_then_more(at_once: bool) -> int:
    """Answers 1 and leaves work for after the reply: it waits until its caller has the reply."""
    got = threading.Event()
    AFTER.append(got)

    def more() -> None:
        THREADS.append(f"after:{threading.current_thread().name}:{got.wait(timeout=30)}")

    transport.after_reply(more)
    return 1


HELD_LOCK = threading.Lock()
GOT_LOCK: list[bool] = []


@transport.at_once(lambda: True)
def holds_a_lock_until_after_its_reply() -> int:
    """Takes a lock its after-work lets go of, and calls a process nobody serves: that call fails
    on the I/O thread, whose callback takes the lock (as a PS's liveness drops a lost worker under
    the PS's lock, held by a streamed answer until its rest is written)."""
    HELD_LOCK.acquire()
    failed = SERVING[0].call_async("nobody", transport.name_of(raises), ())
    failed.add_done_callback(lambda _: GOT_LOCK.append(HELD_LOCK.acquire(timeout=5)))
    transport.after_reply(HELD_LOCK.release)
    return 1


SERVING: list[Node] = []


@transport.served
def raises() -> None:
    raise ValueError("a bad value\nand a traceback nobody needs")


@pytest.fixture(autouse=True)
def _clean():
    RAN.clear()
    HELD.clear()
    THREADS.clear()
    AFTER.clear()


def endpoints(tmp_path: Path) -> dict[str, tuple[str, str, Mechanism]]:
    """name: (bind, connect, mechanism) for every way the job's processes connect."""
    port = free_port()
    sockets = tmp_path / "sockets"
    sockets.mkdir(mode=0o700)
    return {
        "tcp+curve": (f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port}", Mechanism("curve", CREDENTIALS)),
        "tcp+plain": (f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port}", Mechanism("plain", CREDENTIALS)),
        "ipc+plain": (f"ipc://{sockets}/ps.sock", f"ipc://{sockets}/ps.sock", Mechanism("plain", CREDENTIALS)),
    }


def pair(tmp_path: Path, way: str = "tcp+curve", client_credentials=CREDENTIALS, timeout: float = 30.0):
    bind, connect, mechanism = endpoints(tmp_path)[way]
    server = Node("ps", mechanism, timeout, serve=bind, store=Store())
    client = Node("worker1", Mechanism(mechanism.name, client_credentials), timeout)
    client.connect("ps", connect)
    return server, client


@pytest.mark.parametrize("way", ["tcp+curve", "tcp+plain", "ipc+plain"])
def test_a_call_goes_and_its_answer_comes_back_both_ways(tmp_path, way):
    server, client = pair(tmp_path, way)
    try:
        vector = torch.arange(1000, dtype=torch.float32)
        reply = client.call_async("ps", transport.name_of(scaled), (vector, Push(1, "worker1", 4))).wait()
        assert isinstance(reply, Reply) and torch.equal(reply.vector, vector * 2) and reply.version == 5
        # the PS calls back over the worker's own connection (a ping)
        back = server.call_async("worker1", transport.name_of(scaled), (torch.ones(3), Push(0, "ps", 0))).wait()
        assert torch.equal(back.vector, torch.full((3,), 2.0))
        assert client.call_async("ps", "store.add", ("k", 3)).wait() == 3
        assert server.store is not None and server.store.get("k") == b"3"
    finally:
        client.close()
        server.close()


@pytest.mark.parametrize("way", ["tcp+curve", "ipc+plain"])
def test_a_large_tensor_arrives_whole_both_ways(tmp_path, way):
    """Over CURVE it travels in frames of about CURVE_CHUNK_BYTES (encrypted one at a time)."""
    server, client = pair(tmp_path, way)
    try:
        vector = torch.randn(3 * (1 << 20) + 5)  # 12 MB: a dozen frames over CURVE
        reply = client.call_async("ps", transport.name_of(scaled), (vector, Push(1, "worker1", 0))).wait()
        assert torch.equal(reply.vector, vector * 2)
    finally:
        client.close()
        server.close()


def test_an_answer_held_as_a_future_holds_no_thread(tmp_path):
    bind, connect, mechanism = endpoints(tmp_path)["tcp+curve"]
    server = Node("ps", mechanism, 30.0, threads=1, serve=bind)
    client = Node("worker1", mechanism, 30.0)
    client.connect("ps", connect)
    try:
        waiting = client.call_async("ps", transport.name_of(held), ())
        while not HELD:
            time.sleep(0.01)
        # the one thread that answers calls is free meanwhile
        quick = client.call_async("ps", transport.name_of(scaled), (torch.ones(2), Push(1, "worker1", 0)))
        assert quick.wait().version == 1 and not waiting.done()
        HELD[0].set_result(Reply(torch.zeros(1), 9, 0, 0))
        assert waiting.wait().version == 9
    finally:
        client.close()
        server.close()


def test_a_call_its_function_answers_at_once_runs_on_the_io_thread_and_its_reply_goes_without_a_wakeup(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(node_module, "POLL_MS", 600_000)  # a reply left for the next turn of the loop would wait
    server, client = pair(tmp_path, "ipc+plain", timeout=60.0)
    try:
        name = transport.name_of(stepped)
        assert client.call_async("ps", name, (torch.ones(2), Push(1, "worker1", 0, finite=True))).wait().version == 1
        assert client.call_async("ps", name, (torch.ones(2), Push(1, "worker1", 3))).wait().version == 4
        assert THREADS == ["ps-io", "ps-call_0"]  # the second push was not proven finite: the pool's
        # held at once: the I/O thread is free meanwhile, and a reply from another thread wakes it
        waiting = client.call_async("ps", transport.name_of(held_at_once), ())
        while not HELD:
            time.sleep(0.01)
        assert client.call_async("ps", name, (torch.ones(2), Push(1, "worker1", 5, finite=True))).wait().version == 6
        threading.Thread(target=HELD[0].set_result, args=(Reply(torch.zeros(1), 9, 0, 0),)).start()
        assert waiting.wait().version == 9
        # arguments its predicate does not take: the pool answers, with the function's own error
        with pytest.raises(RuntimeError, match="TypeError"):
            client.call_async("ps", name, (torch.ones(2),)).wait()
    finally:
        client.close()
        server.close()


@pytest.mark.parametrize("at_once", [True, False])
def test_work_a_served_call_leaves_for_after_its_reply_runs_once_the_caller_has_the_reply(tmp_path, at_once):
    """The rest of a streamed answer's state is written after its reply went: on the I/O thread
    for a call answered at once (the next message waits for it), in the pool thread otherwise."""
    server, client = pair(tmp_path, "ipc+plain", timeout=60.0)
    try:
        name = transport.name_of(answered_then_more)
        assert client.call_async("ps", name, (at_once,)).wait() == 1  # while the work waits for this
        AFTER[0].set()
        deadline = time.monotonic() + 30
        while not THREADS and time.monotonic() < deadline:
            time.sleep(0.01)
        assert THREADS == [f"after:{'ps-io' if at_once else 'ps-call_0'}:True"]
    finally:
        client.close()
        server.close()
    ran: list[int] = []
    transport.after_reply(lambda: ran.append(1))  # outside a served call: at once
    assert ran == [1]


def test_the_work_a_call_answered_at_once_leaves_runs_before_a_failed_calls_callbacks_on_the_io_thread(tmp_path):
    """Else a callback that waits for what the work ends (a lock) would wait on the I/O thread,
    which runs that work: a PS deadlocked when a worker was lost during a streamed answer."""
    server, client = pair(tmp_path, "ipc+plain", timeout=60.0)
    SERVING.append(server)
    try:
        assert client.call_async("ps", transport.name_of(holds_a_lock_until_after_its_reply), ()).wait() == 1
        deadline = time.monotonic() + 30
        while not GOT_LOCK and time.monotonic() < deadline:
            time.sleep(0.01)
        assert GOT_LOCK == [True]
    finally:
        SERVING.clear()
        if GOT_LOCK == [True]:
            HELD_LOCK.release()
        client.close()
        server.close()


def test_a_push_through_shared_memory_is_answered_at_once_only_when_proven_finite_float32():
    from app.exchange.calls import proven_in_slot
    from app.exchange.wire import InSlot

    proven = Push(1, "worker1", 0, finite=True)
    assert proven_in_slot(InSlot(0, "float32", 10), proven)
    assert not proven_in_slot(InSlot(0, "float32", 10), Push(1, "worker1", 0))  # the PS checks it first
    assert not proven_in_slot(InSlot(0, "bfloat16", 10), proven)  # widened first
    assert not proven_in_slot(torch.ones(10), proven)  # over the socket


def test_an_error_or_a_name_not_served_is_the_callers_error_and_runs_nothing(tmp_path):
    server, client = pair(tmp_path)
    try:
        with pytest.raises(RuntimeError, match=r"raises on ps failed: ValueError: a bad value$"):
            client.call_async("ps", transport.name_of(raises), ()).wait()
        with pytest.raises(RuntimeError, match="no such call: subprocess.getoutput"):
            client.call_async("ps", "subprocess.getoutput", ("id",)).wait()
        with pytest.raises(RuntimeError, match="is not connected to ps"):
            server.call_async("worker9", "app.exchange.group.pong", ()).wait()
        assert RAN == []
    finally:
        client.close()
        server.close()


@pytest.mark.parametrize("way", ["tcp+curve", "ipc+plain"])
def test_another_runs_secret_is_refused_before_anything_is_read(tmp_path, way, caplog):
    server, intruder = pair(tmp_path, way, client_credentials=OTHER, timeout=600)
    try:
        with caplog.at_level(logging.WARNING, logger="app.transport"):
            with pytest.raises(RuntimeError, match="another run's secret"):
                intruder.call_async("ps", transport.name_of(scaled), (torch.ones(1), Push(1, "x", 0))).wait()
            # The server's I/O thread logs the refusal as its monitor reports it (a moment later).
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and not any(
                "refused a connection that did not prove the run's secret" in r.getMessage() for r in caplog.records
            ):
                time.sleep(0.05)
        assert RAN == []
        assert any("refused a connection that did not prove the run's secret" in r.getMessage() for r in caplog.records)
    finally:
        intruder.close()
        server.close()


def test_bytes_that_are_not_the_transport_are_dropped_and_the_job_goes_on(tmp_path, caplog):
    server, client = pair(tmp_path)
    bind = server.address
    try:
        port = int(bind.rsplit(":", 1)[1])
        for _ in range(3):
            with socket.create_connection(("127.0.0.1", port)) as raw:
                try:
                    raw.sendall(os.urandom(256 * 1024))
                except OSError:
                    pass  # the server closed the connection at the first bytes it could not take
        # an authenticated peer whose message does not parse: one warning, then the job goes on
        bad = server.context.socket(zmq.DEALER)  # (the server's context: a client of its own)
        bad.setsockopt(zmq.ROUTING_ID, b"worker2")
        bad.setsockopt(zmq.CURVE_SERVERKEY, CREDENTIALS.server_public)
        bad.setsockopt(zmq.CURVE_PUBLICKEY, CREDENTIALS.client_public)
        bad.setsockopt(zmq.CURVE_SECRETKEY, CREDENTIALS.client_secret)
        bad.connect(bind.replace("0.0.0.0", "127.0.0.1"))
        with caplog.at_level(logging.WARNING, logger="app.transport"):
            bad.send_multipart([b"\x80\x04not json", b"x"])
            bad.send_multipart([b'{"k":"c","i":1,"f":"x","v":{"n":"Popen","v":["id"]}}'])
            reply = client.call_async("ps", transport.name_of(scaled), (torch.ones(2), Push(1, "worker1", 0))).wait()
            assert reply.version == 1
            deadline = time.monotonic() + 10
            while not any("worker2" in r.getMessage() for r in caplog.records) and time.monotonic() < deadline:
                time.sleep(0.05)
        bad.close(linger=0)
        dropped = [r.getMessage() for r in caplog.records if "does not parse" in r.getMessage()]
        assert len(dropped) == 1 and "from worker2" in dropped[0], dropped
        assert RAN == ["scaled"]
    finally:
        client.close()
        server.close()


def test_a_call_past_its_timeout_fails_and_its_late_answer_is_dropped(tmp_path):
    server, client = pair(tmp_path)
    try:
        late = client.call_async("ps", transport.name_of(held), (), timeout=0.3)
        with pytest.raises(RuntimeError, match="held on ps failed: .*timed out"):
            late.wait()
        HELD[0].set_result(None)  # answered after all: nobody takes it
        assert client.call_async("ps", "store.add", ("n", 1)).wait() == 1
    finally:
        client.close()
        server.close()


SERVER = """
import sys, time
from app.exchange import node as node_module
from app.exchange import secret, transport
from app.exchange.node import Node
from app.exchange.sockets import Mechanism

@transport.answered_later
def never():
    from torch.futures import Future
    return Future()

node = Node("ps", Mechanism("curve", secret.derive(b"0123456789abcdef" * 4)), 600, serve=sys.argv[1])
print("up", flush=True)
time.sleep(600)
"""


def test_a_peer_that_dies_fails_its_calls_at_once_not_at_their_timeout(tmp_path):
    """A worker's call to a PS that is killed fails with the lost connection (its timeout is 600 s)."""
    (tmp_path / "never_server.py").write_text(SERVER)
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    env = {**app_env(), "PYTHONPATH": f"{REPO}{os.pathsep}{tmp_path}"}
    proc = subprocess.Popen(
        [sys.executable, str(tmp_path / "never_server.py"), endpoint], env=env, stdout=subprocess.PIPE
    )
    client = Node("worker1", Mechanism("curve", CREDENTIALS), 600)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"up\n"
        client.connect("ps", endpoint)
        pending = client.call_async("ps", "__main__.never", ())
        time.sleep(0.5)  # the call is in the PS, held
        assert not pending.done()
        proc.kill()
        proc.wait()
        with pytest.raises(RuntimeError, match="lost the connection to ps .*its process ended"):
            pending.wait()
        with pytest.raises(RuntimeError, match="lost the connection to ps"):  # and at once from then on
            client.call_async("ps", "__main__.never", ()).wait()
    finally:
        client.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_call_back_to_a_peer_that_died_fails_at_once(tmp_path):
    """The PS's ping of a worker whose process is gone: no connection, no wait (the call's own
    timeout, 120 s, would say "timed out" instead)."""
    server, client = pair(tmp_path, timeout=120)
    try:
        assert client.call_async("ps", "store.add", ("x", 1)).wait() == 1  # the PS knows worker1 now
        pending = server.call_async("worker1", transport.name_of(held), ())
        while not HELD:
            time.sleep(0.01)
        client.close()  # as a killed process's sockets close
        with pytest.raises(RuntimeError, match="held on worker1 failed: lost the connection to worker1"):
            pending.wait()
        with pytest.raises(RuntimeError, match="its connection is closed"):
            server.call_async("worker1", "app.exchange.group.pong", ()).wait()
    finally:
        server.close()


def test_an_idle_node_sleeps_and_a_unix_socket_is_removed_when_it_closes(tmp_path):
    server, client = pair(tmp_path, "ipc+plain")
    path = Path(server.address.removeprefix("ipc://"))
    try:
        assert path.exists()
        before = time.process_time()
        time.sleep(1.0)
        assert time.process_time() - before < 0.2  # nothing spins while nothing moves
    finally:
        client.close()
        server.close()
    assert not path.exists()
    assert not server._thread.is_alive() and not client._thread.is_alive()
