"""How the job's processes reach one another: the one module the rest of the app calls a peer
through. Every process (a worker, every PS process, the connectivity check) joins with
`session`, calls another by name with `call` or `call_async`, serves the functions marked
`served` (`answered_later`: its answer is a Future, held without holding a thread), reads the
job's store through `store`, and leaves as the session ends.

The transport is the job's own (app.exchange.node): ZeroMQ sockets that prove the run's secret
(--secret_file) before any message is read, and messages that are a typed header plus raw
tensor buffers (app.exchange.codec), never unpickled. With --socket_dir, UNIX sockets in that
directory (one host: only who may open the directory may connect); else TCP at
--master_addr:--master_port, encrypted (CURVE) unless --encrypt false.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol, TypeVar

from torch.futures import Future

from app.config import Config, UsageError
from app.contract import PS
from app.exchange import secret
from app.exchange.node import AT_ONCE, SERVED, Node
from app.exchange.node import after_reply as _after_reply
from app.exchange.sockets import mechanism_for, unlink_socket
from app.exchange.store import RemoteStore, Store
from app.runtime import lifecycle, machine

log = logging.getLogger("app.transport")
F = TypeVar("F", bound=Callable[..., Any])
ENDPOINT_KEY = "psc/endpoint/"  # + a PS shard's name: where it listens (set by the shard as it joins)
_NODES: list[Node] = []  # this process's node while its session lasts


class KeyValues(Protocol):
    """The job's store, as group membership uses it (app.exchange.store: the main PS's, or a
    connection to it)."""

    def add(self, key: str, amount: int) -> int: ...
    def get(self, key: str) -> bytes | None: ...
    def set(self, key: str, value: str) -> None: ...
    def check(self, keys: list[str]) -> bool: ...
    def delete_key(self, key: str) -> bool: ...


def name_of(function: Callable[..., Any]) -> str:
    """The name a call of `function` travels under: its module and qualified name."""
    return f"{function.__module__}.{function.__qualname__}"


def served(function: F) -> F:
    """Mark `function` as one other processes may call (no other name is answered)."""
    SERVED[name_of(function)] = function
    return function


def at_once(when: Callable[..., bool]) -> Callable[[F], F]:
    """Mark a served function as answered on the transport's I/O thread as its call arrives,
    for the calls whose arguments `when` accepts: no handoff to a pool thread and back. Only
    for work that never waits for another call's answer (nor for a lock held across one),
    short enough to hold up the process's other messages for: a push through shared memory."""

    def mark(function: F) -> F:
        AT_ONCE[name_of(served(function))] = when
        return function

    return mark


def after_reply(work: Callable[[], None]) -> None:
    """Called by a served function: run `work` on the thread that serves the call once its reply
    has gone (the rest of a streamed answer's state); outside a served call, at once."""
    _after_reply(work)


def answered_later(function: F) -> F:
    """A served function that returns a Future of its answer: the call holds no thread of the
    server while the answer waits (app.exchange.node replies once the Future is done)."""
    return served(function)


# The session, and calls.


@contextmanager
def session(config: Config, rank: int, name: str | None = None) -> Iterator[None]:
    """Be in the job as `name` (default config.name; `rank` is the process's id in the job, kept
    for its logs). The main PS listens (and holds the store); a PS shard listens too, and says
    where in the store; every process but the main PS connects to it."""
    name = name or config.name
    node = _node(config, name, listens=config.role == "ps")
    try:
        if config.role == "ps" and config.shard:
            where = advertised(node.address, config)
            _remote(node, config.rpc_timeout).set(f"{ENDPOINT_KEY}{name}", where)
        _NODES.append(node)
        log.info("%s joined the job", name)
        yield
    finally:
        if node in _NODES:
            _NODES.remove(node)
        node.close()


def call(to: str, function: Callable[..., Any], args: tuple[Any, ...] = (), timeout: float = -1) -> Any:
    """`function(*args)` run in the process named `to`; its answer (RuntimeError when the call
    failed or timed out: `timeout` seconds, -1 the job's --rpc_timeout)."""
    return call_async(to, function, args, timeout).wait()


def call_async(to: str, function: Callable[..., Any], args: tuple[Any, ...] = (), timeout: float = -1) -> Future:
    """The same, not waited for: a future of the answer (`.wait()` raises as `call` does)."""
    if not _NODES:
        return _failed(f"{name_of(function)} on {to} failed: this process is not in the job (no session)")
    node = _NODES[-1]
    if not node.knows(to):
        where = _endpoint_of(node, to, timeout)
        if where is None:
            return _failed(f"{name_of(function)} on {to} failed: {to} is not in the job")
        node.connect(to, where)
    return node.call_async(to, name_of(function), tuple(args), timeout)


def _failed(why: str) -> Future:
    failed: Future = Future()
    failed.set_exception(RuntimeError(why))
    return failed


def _endpoint_of(node: Node, name: str, timeout: float) -> str | None:
    """Where the PS shard `name` listens, as it said in the store."""
    found = (
        node.store.get(f"{ENDPOINT_KEY}{name}")
        if node.store is not None
        else _remote(node, timeout).get(f"{ENDPOINT_KEY}{name}")
    )
    return found.decode() if isinstance(found, bytes) else found


# The store.


@contextmanager
def store(config: Config, timeout: float) -> Iterator[KeyValues]:
    """The job's store: the main PS's, reached from any process, in the job or not yet (a short
    connection of its own then). Its calls raise RuntimeError when the PS does not answer within
    `timeout`."""
    if _NODES and _NODES[-1].store is not None:
        yield _NODES[-1].store
        return
    if _NODES:
        yield _remote(_NODES[-1], timeout)
        return
    node = _node(config, f"{config.name}.{os.getpid()}.store", listens=False)
    try:
        yield _remote(node, timeout)
    finally:
        node.close()


def own_store(config: Config, timeout: float) -> KeyValues:
    """The store as the main PS holds it, within its session (kept for the session's length)."""
    if not _NODES or _NODES[-1].store is None:
        raise RuntimeError("the job's store is the main parameter server's, within its session")
    return _NODES[-1].store


def _remote(node: Node, timeout: float) -> RemoteStore:
    def ask(function: str, args: tuple[Any, ...], seconds: float) -> Any:
        return node.call_async(PS, function, args, seconds).wait()

    return RemoteStore(ask, timeout)


# Where a process listens and connects.


def wait_for_ps(config: Config, timeout: float) -> None:
    """Until the main PS listens (machine.PortUnreachable after `timeout`): its TCP port, or its
    UNIX socket."""
    if config.socket_dir:
        machine.wait_for_socket(os.path.join(config.socket_dir, f"{PS}.sock"), timeout)
    else:
        machine.wait_for_port(config.master_addr, config.master_port, timeout)


def ps_endpoint(config: Config) -> str:
    """Where the main PS listens, as others connect to it."""
    if config.socket_dir:
        return f"ipc://{os.path.join(config.socket_dir, PS)}.sock"
    return f"tcp://{config.master_addr}:{config.master_port}"


def listen_endpoint(config: Config, name: str) -> str:
    """Where a PS process binds: the main PS at --master_port (every interface), a shard on a
    port of the system's choice; or each its UNIX socket in --socket_dir."""
    if config.socket_dir:
        return f"ipc://{os.path.join(config.socket_dir, PS if not config.shard else name)}.sock"
    return f"tcp://*:{config.master_port}" if not config.shard else "tcp://*:0"


def advertised(bound: str, config: Config) -> str:
    """The endpoint others connect to for a socket bound at `bound`: a TCP wildcard becomes this
    host's address on the route to the main PS."""
    if not bound.startswith("tcp://"):
        return bound
    port = bound.rsplit(":", 1)[1]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((config.master_addr, config.master_port))  # no packet: a route is chosen
        host = probe.getsockname()[0]
    return f"tcp://{host}:{port}"


def _node(config: Config, name: str, listens: bool) -> Node:
    if not config.secret_file:
        raise UsageError(
            "--secret_file is required: a file only the job's processes can read, "
            "holding the run's secret (the orchestrator makes one for each run)"
        )
    main = listens and not config.shard
    if main and not os.path.exists(config.secret_file):
        secret.make(config.secret_file)  # the run's first process: every other one reads it
    try:
        credentials = secret.derive(secret.read(config.secret_file))
    except ValueError as error:
        raise UsageError(str(error)) from None
    mechanism = mechanism_for(ps_endpoint(config), credentials, config.encrypt)
    if config.socket_dir:
        private_directory(config.socket_dir)
    node = Node(
        name,
        mechanism,
        config.rpc_timeout,
        threads=max(8, 2 * (config.max_trainers + 1)),
        serve=listen_endpoint(config, name) if listens else None,
        store=Store() if main else None,
    )
    if not main:
        node.connect(PS, ps_endpoint(config))
    if node.address:  # its socket's file goes however the process ends, short of SIGKILL
        lifecycle.on_exit(functools.partial(unlink_socket, node.address))
    return node


def private_directory(path: str) -> None:
    """`path` made 0700 when missing; UsageError unless it is this user's and closed to everyone
    else (the kernel then refuses every other account's connection before a byte is read)."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    mode = os.stat(path)
    if mode.st_uid != os.getuid() or mode.st_mode & 0o077:
        raise UsageError(
            f"--socket_dir {path} must be this user's (uid {os.getuid()}) and closed to everyone else "
            f"(mode 0700); it is uid {mode.st_uid}'s, mode {stat.S_IMODE(mode.st_mode):04o}"
        )
