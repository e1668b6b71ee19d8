"""One process's end of the job's own transport: ZeroMQ sockets, one I/O thread, calls by name.

A process that serves (every PS process) binds one ROUTER socket; a process that calls another
(a worker calls the PS and its shards, a shard calls the main PS) connects a DEALER socket to
it, with its name as the socket's routing id. Both ways of a connection carry calls: the PS
pings a worker over the worker's own connection. Every socket authenticates before any message
is read (app.exchange.secret: CURVE over TCP, PLAIN over a UNIX socket or an unencrypted TCP
link; the ROUTER's ZAP handler admits only the job's credentials).

A message is a header and frames (app.exchange.codec): a call {"k": "c", "i": id, "f": name}
with its arguments, its reply {"k": "r", "i": id} with the value, or {"k": "e", "i": id, "m":
why} when the call failed. A call names a function a process serves (`SERVED`, filled by
app.exchange.transport.served); any other name is answered with an error. A served function may
return a Future: the reply goes once it is done, and no thread waits for it meanwhile.

Only the I/O thread touches a socket; other threads hand it what to send (a queue and a pipe
that wakes it). Calls are answered in a pool of threads, but for a call its function says it
answers at once (`AT_ONCE`: it never waits for another call, as a worker's push does not),
which the I/O thread runs as it arrives and whose reply it sends as soon as it is ready. A
peer that is gone is found out: its connection closing (a process that died), or, for one
that stopped answering, the heartbeats of the connection (ZMTP's PING, `timeout` seconds). A
call to it then fails at once; every call also fails past its own timeout.
"""

from __future__ import annotations

import collections
import functools
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import zmq
import zmq.auth.thread
import zmq.utils.monitor
from torch.futures import Future

from app.exchange import codec, sockets
from app.exchange.pending import PendingCalls
from app.exchange.sockets import Mechanism, unlink_socket
from app.exchange.store import CALLS as STORE_CALLS
from app.exchange.store import Store
from app.runtime.words import first_line

log = logging.getLogger("app.transport")
SERVED: dict[str, Callable[..., Any]] = {}  # what any process answers, by name (app.exchange.transport.served)
# Served functions answered on the I/O thread as their call arrives, where their predicate says so
# of the call's arguments (app.exchange.transport.at_once): no handoff to the pool and back.
AT_ONCE: dict[str, Callable[..., bool]] = {}
POLL_MS = 1000  # the I/O thread wakes at least this often to expire calls (it sleeps in between)
# Over CURVE, a tensor travels in frames of about this many bytes (app.exchange.codec): ZeroMQ
# encrypts a frame at a time, so encryption overlaps the link instead of preceding it.
CURVE_CHUNK_BYTES = 1 << 20


def run_served(function: str, args: Any, store: Store | None) -> tuple[Any, str]:
    """(what the served `function(*args)` returned, '') or (None, why the caller gets an error):
    a name no process serves, arguments that are not a tuple, or what the function raised."""
    served = SERVED.get(function)
    if function in STORE_CALLS and store is not None:
        served = functools.partial(store.answer, function)
    if served is None:
        return None, f"no such call: {function}"
    if not isinstance(args, tuple):
        return None, f"{function}: its arguments are not a tuple"
    if function in STORE_CALLS:
        args = (args,)
    try:
        return served(*args), ""
    except Exception as error:  # noqa: BLE001 - the caller gets it, as a local call would raise it
        return None, f"{type(error).__name__}: {first_line(error)}"


_AFTER = threading.local()  # the work to run once the reply of the call this thread serves has gone


def after_reply(work: Callable[[], None]) -> None:
    """Run `work` on this thread once the reply of the call it is serving has gone to the I/O
    thread (sent already, for a call answered at once), or at once outside a served call."""
    works = getattr(_AFTER, "works", None)
    if works is None:
        work()
    else:
        works.append(work)


def _run_after(works: list[Callable[[], None]]) -> None:
    for work in works:
        try:
            work()
        except Exception:  # noqa: BLE001 - its call was answered: say so, and serve on
            log.exception("the work after a reply failed")


def answered_at_once(function: str, args: Any) -> bool:
    """Whether the I/O thread answers this call itself (AT_ONCE says so of its arguments)."""
    answers = AT_ONCE.get(function)
    if answers is None or not isinstance(args, tuple):
        return False
    try:
        return bool(answers(*args))
    except Exception:  # noqa: BLE001 - arguments it does not take: the pool answers, with the error
        return False


ReplyTo = tuple[zmq.Socket, "bytes | None"]  # the socket a call came in on, and its caller's routing id


class Answers:
    """Calls in, and their replies: a served function run (in the pool, or at once on the I/O
    thread), and its reply, once it is ready, handed to the I/O thread (`send`) as frames."""

    def __init__(self, store: Store | None, chunk: int, send: Callable[[tuple[Any, ...]], None]) -> None:
        self.store, self.chunk, self.send = store, chunk, send

    def serve(self, reply_to: ReplyTo, call: int, function: str, args: Any) -> list[Callable[[], None]]:
        """Run the call and hand its reply on (once a Future it returned is done); the work the
        function left for after its reply (`after_reply`), for the caller to run once the reply
        has gone."""
        _AFTER.works = []
        try:
            result, error = run_served(function, args, self.store)
            if error:
                self.reply(reply_to, call, error=error)
            elif isinstance(result, torch._C.Future):  # torch.futures.Future, or what its `then` returns
                result.add_done_callback(lambda done: self._done(reply_to, call, done))
            else:
                self.reply(reply_to, call, value=result)
        finally:
            works, _AFTER.works = _AFTER.works, None
        return works

    def serve_then(self, reply_to: ReplyTo, call: int, function: str, args: Any) -> None:
        """`serve`, then the work it left (a pool thread's call: its reply is with the I/O thread)."""
        _run_after(self.serve(reply_to, call, function, args))

    def _done(self, reply_to: ReplyTo, call: int, done: Future) -> None:
        try:
            value = done.value()
        except Exception as error:  # noqa: BLE001
            self.reply(reply_to, call, error=f"{type(error).__name__}: {first_line(error)}")
            return
        self.reply(reply_to, call, value=value)

    def reply(self, reply_to: ReplyTo, call: int, value: Any = None, error: str = "") -> None:
        try:
            header = {"k": "e", "i": call, "m": error} if error else {"k": "r", "i": call}
            frames = codec.pack(header, value, self.chunk)
        except TypeError as why:
            frames = codec.pack({"k": "e", "i": call, "m": f"the answer cannot be sent: {why}"})
        self.send(("reply", reply_to, frames))


class Peer:
    """An outgoing connection: its socket, its monitor, and what its handshakes said."""

    def __init__(self, name: str, endpoint: str, socket: zmq.Socket, monitor: zmq.Socket) -> None:
        self.name, self.endpoint, self.socket, self.monitor = name, endpoint, socket, monitor
        self.connected = False
        self.failed = ""  # why calls to it fail at once, once it is lost or refused us


class Node:
    """The transport of one process: `serve` binds the endpoint others connect to (None: this
    process only calls); `store`: the job's key-value store, on the main PS only."""

    def __init__(
        self,
        name: str,
        mechanism: Mechanism,
        timeout: float,
        threads: int = 8,
        serve: str | None = None,
        store: Store | None = None,
    ) -> None:
        self.name, self.mechanism, self.timeout, self.store = name, mechanism, timeout, store
        self._chunk = CURVE_CHUNK_BYTES if mechanism.name == "curve" else 0
        self._answers = Answers(store, self._chunk, self._command)
        self.context = zmq.Context()
        self.context.setsockopt(zmq.LINGER, 0)
        self.peers: dict[str, Peer] = {}
        self.seen: set[str] = set()  # names that called this process's ROUTER (it can call them back)
        self._connected: set[str] = set()  # names connected to (or about to be)
        self._pending = PendingCalls()
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._commands: collections.deque[tuple[Any, ...]] = collections.deque()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._warned: set[str] = set()
        self._refused = sockets.Refusals(name, log)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix=f"{name}-call")
        self._auth: zmq.auth.thread.ThreadAuthenticator | None = None
        self.router: zmq.Socket | None = None
        self.router_monitor: zmq.Socket | None = None
        self.address = ""
        if serve is not None:
            self._serve(serve)
        self._poller = zmq.Poller()
        self._poller.register(self._wake_r, zmq.POLLIN)
        if self.router is not None:
            self._poller.register(self.router, zmq.POLLIN)
            self._poller.register(self.router_monitor, zmq.POLLIN)
        self._stopping = False
        self._probed = 0.0  # when _probe_callers last ran
        self._thread = threading.Thread(target=self._loop, name=f"{name}-io", daemon=True)
        self._thread.start()

    # Set-up and end.

    def _serve(self, endpoint: str) -> None:
        served = sockets.serving(self.context, endpoint, self.mechanism)
        self._auth, self.router, self.router_monitor, self.address = served

    def close(self) -> None:
        """Stop: calls still pending fail; nothing is waited for (a peer may be gone)."""
        if self._stopping:
            return
        self._command(("stop",))
        self._thread.join(timeout=10)
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._auth is not None:
            self._auth.stop()
        self.context.destroy(linger=0)
        unlink_socket(self.address)
        os.close(self._wake_r)
        os.close(self._wake_w)

    # Calls out.

    def connect(self, name: str, endpoint: str) -> None:
        """Calls to `name` go to `endpoint`, over a connection of its own (made once: a second
        connect of the same name is ignored)."""
        with self._lock:
            if name in self._connected:
                return
            self._connected.add(name)
        self._command(("connect", name, endpoint))

    def knows(self, name: str) -> bool:
        """Whether a call to `name` has a way to go: a connection to it, or its calls to this process."""
        with self._lock:
            return name in self._connected or name in self.seen

    def call_async(self, to: str, function: str, args: tuple[Any, ...], timeout: float = -1) -> Future:
        """A future of `function(*args)` run in the process named `to`: its value, or a
        RuntimeError saying why not (the error it raised there, a lost peer, the timeout)."""
        future: Future = Future()
        seconds = timeout if timeout and timeout > 0 else self.timeout
        call = next(self._ids)
        try:
            frames = codec.pack({"k": "c", "i": call, "f": function}, tuple(args), self._chunk)
        except TypeError as error:
            future.set_exception(RuntimeError(f"{function} cannot be sent: {error}"))
            return future
        with self._lock:
            peer = self.peers.get(to)
            if peer is not None and peer.failed:
                future.set_exception(RuntimeError(peer.failed))
                return future
            self._pending.add(call, future, to, seconds, f"{function} on {to}")
        self._command(("send", to, frames, call))
        return future

    # The I/O thread.

    def _command(self, command: tuple[Any, ...]) -> None:
        self._commands.append(command)
        if threading.current_thread() is not self._thread:
            os.write(self._wake_w, b"x")

    def _loop(self) -> None:
        try:
            while not self._stopping:
                ready = dict(self._poller.poll(self._pending.ms_to_next_deadline(POLL_MS)))
                if self._wake_r in ready:
                    try:
                        os.read(self._wake_r, 4096)
                    except BlockingIOError:
                        pass
                self._run_commands()
                for socket in ready:
                    if not isinstance(socket, zmq.Socket):
                        continue  # the wake-up pipe
                    if socket is self.router:
                        self._drain(socket, routed=True)
                    elif socket is self.router_monitor:
                        self._server_event(socket)
                    else:
                        self._peer_socket(socket)
                self._pending.expire()
                if self.router is not None and time.monotonic() - self._probed >= POLL_MS / 1000:
                    self._probe_callers()  # a DISCONNECTED event can come before the ROUTER drops the peer
        except Exception:  # a bug here would hang every call: say so, and fail them
            log.exception("%s: the transport's I/O thread stopped", self.name)
        finally:
            self._stopping = True
            self._pending.fail_all("the transport is closed")

    def _run_commands(self, replies_only: bool = False) -> None:
        """Carry out the commands handed to the I/O thread, in order; `replies_only`: write the
        replies, and keep the others, in their order, for the next run."""
        kept: collections.deque[tuple[Any, ...]] = collections.deque()
        while self._commands:
            command = self._commands.popleft()
            kind = command[0]
            if replies_only and kind != "reply":
                kept.append(command)
                continue
            if kind == "send":
                self._send(*command[1:])
            elif kind == "reply":
                (socket, routing), frames = command[1], command[2]
                sockets.write(socket, [routing, *frames] if routing is not None else frames)
            elif kind == "connect":
                self._connect(command[1], command[2])
            elif kind == "stop":
                self._stopping = True
        self._commands.extendleft(reversed(kept))

    def _send(self, to: str, frames: list[Any], call: int) -> None:
        peer = self.peers.get(to)
        if peer is not None:
            why = peer.failed or sockets.write(peer.socket, frames)
            if why and not peer.failed:
                # libzmq drops a connection's queue once its handshake fails, after telling the
                # monitor why: that reason, not the send's EAGAIN, is the caller's.
                self._peer_events(peer)
                why = peer.failed or why
        elif self.router is not None and to in self.seen:
            why = sockets.write(self.router, [to.encode(), *frames])
        else:
            why = f"{to} is not connected to {self.name}"
        if why:
            self._pending.fail(call, why)

    def _connect(self, name: str, endpoint: str) -> None:
        if name in self.peers:
            return
        socket, monitor = sockets.calling(self.context, self.name, endpoint, self.mechanism, self.timeout)
        peer = Peer(name, endpoint, socket, monitor)
        with self._lock:
            self.peers[name] = peer
        self._poller.register(socket, zmq.POLLIN)
        self._poller.register(monitor, zmq.POLLIN)

    def _peer_socket(self, socket: zmq.Socket) -> None:
        for peer in list(self.peers.values()):
            if socket is peer.socket:
                self._drain(socket, routed=False, peer=peer.name)
            elif socket is peer.monitor:
                self._peer_events(peer)

    def _drain(self, socket: zmq.Socket, routed: bool, peer: str = "") -> None:
        for _ in range(64):  # then the other sockets get their turn
            try:
                frames = socket.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            routing = frames[0].bytes if routed else None
            self._received(socket, routing, frames[1:] if routed else frames, peer)

    def _received(self, socket: zmq.Socket, routing: bytes | None, frames: list[Any], peer: str) -> None:
        sender = routing.decode(errors="replace") if routing is not None else peer
        if routing is not None:
            with self._lock:
                self.seen.add(sender)
        try:
            header, value = codec.unpack(frames)
            kind, call = header.get("k"), header.get("i")
            if kind == "p":  # a probe of the connection (_probe_callers): nothing to do
                return
            if not isinstance(call, int) or kind not in ("c", "r", "e"):
                raise codec.Malformed(f"a header of kind {str(kind)[:10]!r}")
        except codec.Malformed as error:
            self._malformed(sender, frames, error)
            return
        if kind == "c":
            function = header.get("f")
            if not isinstance(function, str):
                self._malformed(sender, frames, codec.Malformed("a call without a function's name"))
                return
            if answered_at_once(function, value):
                after = self._answers.serve((socket, routing), call, function, value)
                # Its reply (when it is ready) goes now, and the work it left runs before any other
                # command: failing a call to a lost peer runs that call's callbacks here, and one
                # may wait for what the work ends (a PS's lock held until its answer is written).
                self._run_commands(replies_only=True)
                _run_after(after)
                self._run_commands()
            else:
                self._pool.submit(self._answers.serve_then, (socket, routing), call, function, value)
            return
        if kind == "r":
            self._pending.answer(call, sender, value=value)
        else:
            self._pending.answer(call, sender, error=str(header.get("m")))

    def _malformed(self, sender: str, frames: list[Any], error: Exception) -> None:
        """Dropped, with one warning per sender; a reply that does not parse fails its call."""
        try:
            call = codec.header_of(frames).get("i")
        except (ValueError, UnicodeDecodeError):
            call = None
        if self._pending.to_of(call) == sender:
            self._pending.fail(call, f"its answer does not parse: {error}")  # type: ignore[arg-type]
        if sender not in self._warned:
            self._warned.add(sender)
            log.warning("%s: dropped a message from %s that does not parse (%s)", self.name, sender, error)

    def _peer_events(self, peer: Peer) -> None:
        """Every event its monitor holds, in order."""
        while True:
            try:
                event = zmq.utils.monitor.recv_monitor_message(peer.monitor, zmq.NOBLOCK)["event"]
            except zmq.Again:
                return
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                peer.connected = True
            why = sockets.why_lost(event, peer.name, peer.endpoint, peer.connected)
            if why:
                self._lost(peer, why)

    def _lost(self, peer: Peer, why: str) -> None:
        with self._lock:
            peer.failed = why
        self._pending.fail_to(peer.name, why)

    def _server_event(self, monitor: zmq.Socket) -> None:
        event = zmq.utils.monitor.recv_monitor_message(monitor)["event"]
        if event == zmq.EVENT_DISCONNECTED:
            self._probe_callers()
        elif event in (zmq.EVENT_HANDSHAKE_FAILED_AUTH, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL):  # not the job's
            self._refused.one()
        # A connection closed before its handshake (a probe of the port, a health check): closed, and
        # nothing is said.

    def _probe_callers(self) -> None:
        """Fail the calls to a caller that is gone: on a connection to the ROUTER closing, and each
        POLL_MS while calls wait on callers (the ROUTER forgets a closed connection a moment after
        its monitor tells of it)."""
        self._probed = time.monotonic()
        with self._lock:
            waiting = self._pending.waiting_on() - set(self.peers)
        for name in waiting:
            if sockets.write(self.router, [name.encode(), *codec.pack({"k": "p", "i": 0})]):  # type: ignore[arg-type]
                self._pending.fail_to(name, f"lost the connection to {name}: its process ended")
