"""A round trip of the state between two processes, one thread each: CPU seconds of both sides
and wall seconds, per round trip; and the control round trip, a message of a few numbers (what
a push through the PS's shared memory carries: the slot and the push's fields).

The app's: its own transport (app.exchange.transport), a worker calling the main PS, which
answers with the tensor it got; over a UNIX socket (PLAIN, as a local run's processes talk,
`make local`) and over TCP on 127.0.0.1, encrypted (CURVE, as processes on different hosts
talk). The reference: torch RPC over TensorPipe's `uv` transport and its `basic` channel (TCP),
what the app used before its own transport; torch RPC is the bench's here, not the app's.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from app.exchange import transport

WAYS = {  # the figures' prefix -> how the state travels
    "transport_unix": "unix",
    "transport_tcp_curve": "tcp",
    "tensorpipe_uv": "tensorpipe",
}
WARMUP = 3  # untimed round trips first
CONTROL_FLOATS = 8  # a control message: a few numbers
CONTROL_REPEATS = 200
TIMEOUT = 120.0  # seconds for either process to be ready, and for the caller's figures


@transport.served
def echo(message: torch.Tensor) -> torch.Tensor:
    """The message, back as it came."""
    return message


@transport.at_once(lambda message: True)
def echo_at_once(message: torch.Tensor) -> torch.Tensor:
    """The same, answered on the I/O thread as a push through shared memory is
    (app.exchange.calls.rpc_push)."""
    return message


@transport.served
def cpu_now() -> float:
    """This process's CPU seconds so far (every thread's)."""
    return time.process_time()


def _timed(call: Any, floats: int, repeats: int, answer: Any = echo) -> tuple[float, float]:
    """(CPU seconds of both sides, wall seconds) per round trip of `floats` values, `call(fn,
    args)` running fn in the other process; `answer`: the function that sends them back."""
    message = torch.randn(floats)
    for _ in range(WARMUP):
        message = call(answer, (message,))
    peer, mine, wall = call(cpu_now, ()), time.process_time(), time.perf_counter()
    for _ in range(repeats):
        message = call(answer, (message,))
    wall = time.perf_counter() - wall
    peer, mine = call(cpu_now, ()) - peer, time.process_time() - mine
    return (mine + peer) / repeats, wall / repeats


def _transport_config(rank: int, way: str, files: dict[str, str], port: int) -> Any:
    """The job of two: the main PS (rank 0) and worker 1, on the case's secret; a UNIX socket in
    the case's directory, or TCP on 127.0.0.1 with CURVE."""
    from app.config import parse

    argv = ["ps"] if rank == 0 else ["worker", "--rank", "1"]
    argv += ["--world_size", "2", "--master_addr", "127.0.0.1", "--master_port", str(port)]
    argv += ["--secret_file", files["secret_file"], "--rpc_timeout", str(TIMEOUT)]
    argv += ["--socket_dir", files["socket_dir"]] if way == "unix" else ["--encrypt", "true"]
    return parse(argv, {})


def _transport_process(
    rank: int, way: str, floats: int, files: dict[str, str], port: int, repeats: int, out: Any, done: Any
) -> None:
    """Rank 1 times `repeats` round trips to rank 0 and puts the figures in `out`; rank 0 answers
    until `done` is set (after the caller's last answer came)."""
    from app.contract import PS
    from app.runtime import machine

    machine.keep_freed_memory()
    torch.set_num_threads(1)
    config = _transport_config(rank, way, files, port)
    if rank:
        transport.wait_for_ps(config, TIMEOUT)
    with transport.session(config, rank):
        if rank == 0:
            done.wait(TIMEOUT)
            return
        call = lambda fn, args: transport.call(PS, fn, args, TIMEOUT)  # noqa: E731
        control = _timed(call, CONTROL_FLOATS, CONTROL_REPEATS, echo_at_once)  # as a push in a slot is answered
        out.put((_timed(call, floats, repeats), control))
        done.set()


def _tensorpipe_process(
    rank: int, way: str, floats: int, files: dict[str, str], port: int, repeats: int, out: Any, done: Any
) -> None:
    """The same with torch RPC (TensorPipe, uv transport, basic channel), ended by its graceful
    shutdown."""
    import warnings

    import torch.distributed.rpc as rpc

    from app.runtime import machine

    warnings.filterwarnings("ignore", message="You are using a Backend")  # torch's own, at init and shutdown
    machine.keep_freed_memory()
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TP_SOCKET_IFNAME="lo")
    options = rpc.TensorPipeRpcBackendOptions(num_worker_threads=4, _transports=["uv"], _channels=["basic"])
    rpc.init_rpc(f"echo{rank}", rank=rank, world_size=2, rpc_backend_options=options)
    if rank == 1:
        call = lambda fn, args: rpc.rpc_sync("echo0", fn, args)  # noqa: E731
        out.put((_timed(call, floats, repeats), _timed(call, CONTROL_FLOATS, CONTROL_REPEATS)))
    rpc.shutdown()


def round_trips(floats: int, repeats: int) -> dict[str, float]:
    """`<way>_cpu_s` and `<way>_wall_s` for each way of WAYS: `repeats` round trips of `floats`
    values, two processes started for each way; `<way>_control_cpu_s` and `<way>_control_wall_s`:
    the same of CONTROL_FLOATS values, CONTROL_REPEATS times."""
    import torch.multiprocessing as mp

    from bench.procs import free_port, job_files

    context = mp.get_context("spawn")
    figures = {}
    for name, way in WAYS.items():
        out, done = context.SimpleQueue(), context.Event()
        entry = _tensorpipe_process if way == "tensorpipe" else _transport_process
        with tempfile.TemporaryDirectory(prefix="bench-rt-") as tmp:
            args = (way, floats, job_files(Path(tmp)), free_port(), repeats, out, done)
            mp.start_processes(entry, args=args, nprocs=2, start_method="spawn")
        (cpu, wall), (control_cpu, control_wall) = out.get()
        figures.update({f"{name}_cpu_s": cpu, f"{name}_wall_s": wall})
        figures.update({f"{name}_control_cpu_s": control_cpu, f"{name}_control_wall_s": control_wall})
    return figures
