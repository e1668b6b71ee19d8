"""The sockets of the job's own transport (app.exchange.node), each made to prove the run's secret.

A serving process binds a ROUTER behind a ZAP handler that admits only the job's credentials; a
calling process connects a DEALER that presents them (app.exchange.secret): CURVE over TCP,
PLAIN over a UNIX socket or an unencrypted TCP link. Each socket comes with a monitor, whose
events tell the node a peer connected, left or was refused.
"""

from __future__ import annotations

import errno
import hmac
import logging
import os
import time
from typing import Any, NamedTuple

import zmq
import zmq.auth.thread

from app.exchange.secret import USER, Credentials

DOMAIN = b"psc"
HEARTBEAT_MS = 1000
PEER_EVENTS = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)
SERVER_EVENTS = (
    zmq.EVENT_DISCONNECTED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)


class Mechanism(NamedTuple):
    """How a socket proves the job's secret: `curve` (encrypted) or `plain`."""

    name: str
    credentials: Credentials


class Served(NamedTuple):
    """A bound ROUTER: its authenticator, the socket, its monitor and the address it bound."""

    auth: zmq.auth.thread.ThreadAuthenticator
    router: zmq.Socket
    monitor: zmq.Socket
    address: str


def serving(context: zmq.Context, endpoint: str, mechanism: Mechanism) -> Served:
    """A ROUTER bound at `endpoint` that reads nothing from a connection until it proved the secret."""
    name, credentials = mechanism
    auth = zmq.auth.thread.ThreadAuthenticator(context, log=logging.getLogger("app.transport.zap"))
    auth.start()
    if name == "curve":
        auth.configure_curve_callback(DOMAIN.decode(), _OnlyKey(credentials.client_public))
    else:
        auth.configure_plain(DOMAIN.decode(), {USER.decode(): credentials.password.decode()})
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a call to a peer that is gone fails at once
    router.setsockopt(zmq.ROUTER_HANDOVER, 1)
    router.setsockopt(zmq.ZAP_DOMAIN, DOMAIN)
    if name == "curve":
        router.setsockopt(zmq.CURVE_SERVER, 1)
        router.setsockopt(zmq.CURVE_SECRETKEY, credentials.server_secret)
    else:
        router.setsockopt(zmq.PLAIN_SERVER, 1)
    monitor = router.get_monitor_socket(SERVER_EVENTS)
    router.bind(endpoint)
    return Served(auth, router, monitor, router.getsockopt_string(zmq.LAST_ENDPOINT))


def calling(
    context: zmq.Context, name: str, endpoint: str, mechanism: Mechanism, timeout: float
) -> tuple[zmq.Socket, zmq.Socket]:
    """A DEALER connected to `endpoint` as `name`, and its monitor; ZMTP heartbeats find a peer
    that stopped answering within `timeout` seconds."""
    kind, credentials = mechanism
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.ROUTING_ID, name.encode())
    socket.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_MS)
    socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(timeout * 1000))
    if kind == "curve":
        socket.setsockopt(zmq.CURVE_SERVERKEY, credentials.server_public)
        socket.setsockopt(zmq.CURVE_PUBLICKEY, credentials.client_public)
        socket.setsockopt(zmq.CURVE_SECRETKEY, credentials.client_secret)
    else:
        socket.setsockopt(zmq.PLAIN_USERNAME, USER)
        socket.setsockopt(zmq.PLAIN_PASSWORD, credentials.password)
    monitor = socket.get_monitor_socket(PEER_EVENTS)
    socket.connect(endpoint)
    return socket, monitor


def write(socket: zmq.Socket, frames: list[Any]) -> str:
    """'' once sent, else why not (the peer is gone, or its queue is full)."""
    try:
        socket.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
        return ""
    except zmq.ZMQError as error:
        if error.errno == errno.EHOSTUNREACH:
            return "its connection is closed (the process ended, or its host is unreachable)"
        return f"cannot send: {error}"


class Refusals:
    """Connections refused for not proving the secret: one warning line a minute at most, with the
    count since the last one (a port scan says so once, not once a connection)."""

    EVERY_SECONDS = 60.0

    def __init__(self, name: str, log: logging.Logger) -> None:
        self.name, self.log = name, log
        self.count, self.since = 0, -self.EVERY_SECONDS

    def one(self) -> None:
        now = time.monotonic()
        if now - self.since < self.EVERY_SECONDS:
            self.count += 1
            return
        more = f" ({self.count} more since the last warning)" if self.count else ""
        self.log.warning("%s: refused a connection that did not prove the run's secret%s", self.name, more)
        self.count, self.since = 0, now


class _OnlyKey:
    """The ZAP handler's test of a CURVE client: the job's client key, and no other."""

    def __init__(self, key: bytes) -> None:
        self.key = key

    def callback(self, domain: str, key: bytes) -> bool:
        return hmac.compare_digest(key, self.key)


def unlink_socket(endpoint: str) -> None:
    """Remove the file of a UNIX socket this process bound (libzmq leaves it when the context ends)."""
    if endpoint.startswith("ipc://"):
        try:
            os.unlink(endpoint.removeprefix("ipc://"))
        except FileNotFoundError:
            pass


def mechanism_for(endpoint: str, credentials: Credentials, encrypt: bool = True) -> Mechanism:
    """CURVE over TCP unless `encrypt` is off; PLAIN over a UNIX socket (its directory keeps
    others out, and nothing crosses a network to be read)."""
    return Mechanism("curve" if endpoint.startswith("tcp://") and encrypt else "plain", credentials)


def why_lost(event: int, name: str, endpoint: str, connected: bool) -> str:
    """Why calls to the peer `name` fail from now on, after its connection's monitor told of
    `event`; '' when the connection still stands (or is still being made)."""
    if event == zmq.EVENT_DISCONNECTED and connected:
        return f"lost the connection to {name} ({endpoint}): its process ended or froze"
    if event in (zmq.EVENT_HANDSHAKE_FAILED_AUTH, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL):
        return f"{name} ({endpoint}) refused this process: one of them holds another run's secret"
    if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:  # CURVE: the server could not read our hello
        return (
            f"the handshake with {name} ({endpoint}) failed: one of them holds another run's secret, "
            "or it is not this job's transport"
        )
    return ""
