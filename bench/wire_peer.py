"""The two processes of `python -m bench wire` (bench/wire.py), each run in its own network
namespace: `python -m bench.wire_peer server|client app|raw --addr A --port P ...`.

app: the job's own transport (app.exchange.transport: codec + ZeroMQ + CURVE or PLAIN). The
server joins as the main PS (binds tcp://*:PORT, holds the store); the client joins as worker1
and calls `echo` with a tensor of --floats float32 values (the push), which answers with a tensor
of the same size (the pull: the server's own state, as the PS answers from its reply buffer).

raw: a plain TCP stream of the same bytes: the client sends an 8-byte length then the bytes, the
server reads them all and sends as many back; length 0 asks for the server's CPU seconds, -1
asks for them and ends it.

The client prints one JSON line: each timed round trip's seconds, the repeats' wall seconds, bytes
both ways, and the CPU
seconds (time.process_time: every thread) of the client and of the server over the same window,
and the seconds their threads waited for a CPU (ready to run while the cores ran other threads).
"""

from __future__ import annotations

import argparse
import glob
import json
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

LENGTH = struct.Struct("!q")
CPU = struct.Struct("!dd")
CONNECT_TIMEOUT_S = 60.0


# The app's transport.

_STOP = threading.Event()
_STATE: list[Any] = []  # the server's state: what `echo` answers with


def echo(push: Any) -> Any:
    """The PS's end of a push + pull: the push is read (its size checked), the state answers."""
    state = _STATE[0]
    if push.numel() != state.numel():
        raise ValueError(f"a push of {push.numel()} values; the state holds {state.numel()}")
    return state


def cpu_seconds() -> tuple[float, float]:
    """This process's CPU seconds (every thread), and the seconds its threads waited for a CPU:
    ready to run while the cores ran other threads (/proc/self/task/*/schedstat)."""
    waited = 0
    for task in glob.glob("/proc/self/task/*/schedstat"):
        try:
            with open(task, encoding="ascii") as f:
                waited += int(f.read().split()[1])
        except (OSError, IndexError, ValueError):
            pass  # a thread that ended meanwhile
    return time.process_time(), waited / 1e9


def _spent(before: tuple[float, float], after: tuple[float, float]) -> tuple[float, float]:
    return after[0] - before[0], after[1] - before[1]


def stop() -> None:
    _STOP.set()


def _config(args: argparse.Namespace, role: str) -> Any:
    from app.config import parse
    from app.runtime import machine

    machine.keep_freed_memory()  # as the app's processes do: no fresh mmap per message

    argv = [role, "--master_addr", args.addr, "--master_port", str(args.port), "--secret_file", args.secret]
    argv += ["--encrypt", "true" if args.encrypt else "false", "--world_size", "2", "--rpc_timeout", "120"]
    return parse(argv + (["--rank", "1"] if role == "worker" else []), {})


def app_server(args: argparse.Namespace) -> None:
    import torch

    from app.exchange import transport

    for function in (echo, cpu_seconds, stop):
        transport.served(function)
    _STATE.append(torch.ones(args.floats))
    with transport.session(_config(args, "ps"), rank=0):
        _STOP.wait()
        time.sleep(0.2)  # the reply to `stop` leaves before the socket closes


def app_client(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from app.contract import PS
    from app.exchange import transport

    config = _config(args, "worker")
    transport.wait_for_ps(config, CONNECT_TIMEOUT_S)
    push = torch.ones(args.floats)
    with transport.session(config, rank=1):
        for _ in range(args.warmup):
            transport.call(PS, echo, (push,))
        server0 = tuple(transport.call(PS, cpu_seconds))
        client0, t0 = cpu_seconds(), time.perf_counter()
        trips = []
        for _ in range(args.repeats):
            trips.append(time.perf_counter())
            pull = transport.call(PS, echo, (push,))
            trips[-1] = time.perf_counter() - trips[-1]
            if pull.numel() != args.floats:
                raise RuntimeError(f"a pull of {pull.numel()} values, not {args.floats}")
            del pull
        wall, client = time.perf_counter() - t0, _spent(client0, cpu_seconds())
        server = _spent(server0, tuple(transport.call(PS, cpu_seconds)))
        try:
            transport.call(PS, stop, timeout=5)
        except RuntimeError:
            pass  # the server ended first: the parent makes sure it is gone
    return _figures(trips, wall, client, server)


def _figures(
    trips: list[float], wall: float, client: tuple[float, float], server: tuple[float, float]
) -> dict[str, Any]:
    return dict(
        trips_s=trips,
        wall_s=wall,
        client_cpu_s=client[0],
        server_cpu_s=server[0],
        client_wait_s=client[1],
        server_wait_s=server[1],
    )


# The raw TCP stream.


def _recv_exactly(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("the peer closed the connection")
        got += n


def _recv_length(sock: socket.socket) -> int:
    head = bytearray(LENGTH.size)
    _recv_exactly(sock, memoryview(head))
    return int(LENGTH.unpack(head)[0])


def raw_server(args: argparse.Namespace) -> None:
    nbytes = 4 * args.floats
    buffer = memoryview(bytearray(nbytes))
    with socket.create_server(("", args.port)) as listener:
        conn, _ = listener.accept()
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while True:
            length = _recv_length(conn)
            if length <= 0:
                conn.sendall(CPU.pack(*cpu_seconds()))
                if length < 0:
                    return
                continue
            if length != nbytes:
                raise ValueError(f"a message of {length} bytes; this server takes {nbytes}")
            _recv_exactly(conn, buffer)
            conn.sendall(buffer)


def _connect(addr: str, port: int) -> socket.socket:
    deadline = time.monotonic() + CONNECT_TIMEOUT_S
    while True:
        try:
            return socket.create_connection((addr, port), timeout=5)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def raw_client(args: argparse.Namespace) -> dict[str, Any]:
    nbytes = 4 * args.floats
    push, pull = bytearray(b"\1" * nbytes), memoryview(bytearray(nbytes))
    with _connect(args.addr, args.port) as sock:
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def server_cpu(length: int) -> tuple[float, float]:
            sock.sendall(LENGTH.pack(length))
            answer = bytearray(CPU.size)
            _recv_exactly(sock, memoryview(answer))
            cpu, waited = CPU.unpack(answer)
            return float(cpu), float(waited)

        def round_trip() -> None:
            sock.sendall(LENGTH.pack(nbytes))
            sock.sendall(push)
            _recv_exactly(sock, pull)

        for _ in range(args.warmup):
            round_trip()
        server0 = server_cpu(0)
        client0, t0 = cpu_seconds(), time.perf_counter()
        trips = []
        for _ in range(args.repeats):
            trips.append(time.perf_counter())
            round_trip()
            trips[-1] = time.perf_counter() - trips[-1]
        wall, client = time.perf_counter() - t0, _spent(client0, cpu_seconds())
        server = _spent(server0, server_cpu(-1))
    return _figures(trips, wall, client, server)


ROLES: dict[tuple[str, str], Callable[[argparse.Namespace], Any]] = {
    ("server", "app"): app_server,
    ("client", "app"): app_client,
    ("server", "raw"): raw_server,
    ("client", "raw"): raw_client,
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.wire_peer")
    p.add_argument("role", choices=("server", "client"))
    p.add_argument("path", choices=("app", "raw"))
    p.add_argument("--addr", default="")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--floats", type=int, required=True)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--secret", default="")
    p.add_argument("--encrypt", action="store_true")
    args = p.parse_args(argv)
    result = ROLES[(args.role, args.path)](args)
    if args.role == "client":
        result.update(bytes=2 * 4 * args.floats * args.repeats, repeats=args.repeats)
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    # Served calls travel under their module's name: run this module's functions as
    # bench.wire_peer's, in both processes, not as __main__'s.
    from bench import wire_peer

    sys.exit(wire_peer.main())
