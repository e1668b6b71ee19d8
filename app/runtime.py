"""Process plumbing: logging, threads, device choice, signals, deadlines, exit.

RPC itself (the group's session, calls) is app/exchange/transport.py's.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import logging
import os
import signal
import socket
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

import torch

from app.config import Config, UsageError

log = logging.getLogger("app")
# The progress lines (`worker1 | Epoch: ...`, `Accuracy: ...`, `Time: ...`) go
# through this logger to stdout, bare; diagnostics go through `app` to stderr.
progress = logging.getLogger("app.progress")

LOOPBACK = ("localhost", "127.0.0.1", "::1")


def first_line(error: BaseException) -> str:
    """What an error says, in one line: its first non-empty line that is not torch's
    `On WorkerInfo(...)` preamble, else the exception's type name."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    lines = [line for line in lines if not line.startswith("On WorkerInfo")]
    return lines[0] if lines else type(error).__name__


def counted(count: int, noun: str, plural: str = "") -> str:
    """`1 worker`, `3 workers`: a count and its noun for a log line (`plural` when not noun + s)."""
    return f"{count} {noun if count == 1 else plural or noun + 's'}"


class PortUnreachable(RuntimeError):
    """A TCP port did not accept a connection in time; the message is the last reason."""


def wait_for_port(host: str, port: int, timeout: float, poll: float = 0.2) -> None:
    """Until `host:port` accepts a TCP connection (plain sockets: a clear reason when it
    never does, and none of c10d's retry logs); PortUnreachable after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(2.0, deadline - time.monotonic()))):
                return
        except OSError as error:
            reason = (
                f"cannot resolve {host}"
                if isinstance(error, socket.gaierror)
                else error.strerror or str(error) or type(error).__name__
            )
        if time.monotonic() + poll >= deadline:
            raise PortUnreachable(reason)
        time.sleep(poll)


def set_gloo_interface(master_addr: str) -> None:
    """Gloo binds the interface of this host's name unless told: the loopback for a loopback
    master, else TensorPipe's TP_SOCKET_IFNAME (the render's network.ifname); an explicit
    GLOO_SOCKET_IFNAME wins."""
    if "GLOO_SOCKET_IFNAME" in os.environ:
        return
    if master_addr in LOOPBACK:
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    elif os.environ.get("TP_SOCKET_IFNAME"):
        os.environ["GLOO_SOCKET_IFNAME"] = os.environ["TP_SOCKET_IFNAME"]


def setup_logging(level: int = logging.INFO) -> None:
    """Bare progress lines on line-buffered stdout; timestamped diagnostics on stderr."""
    if isinstance(sys.stdout, io.TextIOWrapper):  # not a stream put in its place (a test's capture)
        sys.stdout.reconfigure(line_buffering=True)
    out = logging.StreamHandler(sys.stdout)
    out.setFormatter(logging.Formatter("%(message)s"))
    progress.handlers[:] = [out]
    progress.propagate = False
    progress.setLevel(logging.INFO)
    err = logging.StreamHandler(sys.stderr)
    err.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    log.handlers[:] = [err]
    log.setLevel(level)
    # torch's own RPC shutdown uses a deprecated ProcessGroup path; not ours to fix.
    warnings.filterwarnings("ignore", message="You are using a Backend", category=UserWarning)


# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_MAX = -1, -2, -4


def keep_freed_memory() -> bool:
    """Serve big tensors from the heap and keep freed memory for the next one.

    Every message TensorPipe receives is a fresh tensor: with glibc's defaults an
    allocation over 32 MB is its own mmap, unmapped again when freed, so each big
    push lands on newly mapped memory (page faults) and each free is a munmap.
    With mmap off and no trimming, freed memory stays in the heap for the next
    message. The price: a process keeps its peak heap. False where the C library
    is not glibc.
    """
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return all(
        mallopt(param, value) == 1
        for param, value in ((_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, 2**31 - 1), (_M_TOP_PAD, 64 << 20))
    )


def sharing_cpus(config: Config) -> int:
    """How many of the job's processes this one shares the host's CPUs with, itself included:
    a worker, every process of the job; a PS process, the PS's processes only: it applies
    each update with the cores its shards leave it (a worker's training waits on its GPU, or
    on the PS's answer, while the PS applies)."""
    if config.role == "ps":
        return config.shards
    return config.world_size + config.shards - 1


def set_threads(world_size: int) -> int:
    """Share the host's cores between `world_size` processes (unless OMP_NUM_THREADS says)."""
    if os.environ.get("OMP_NUM_THREADS"):
        threads = int(os.environ["OMP_NUM_THREADS"])
    else:
        threads = max(1, len(os.sched_getaffinity(0)) // world_size)
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set, or parallel work already ran
        pass
    return threads


def autocast(precision: str, device: torch.device) -> Any:
    """The forward's autocast context for --precision (none for fp32); bf16 runs on CPU too."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16 if precision == "bf16" else torch.float16)


def tune_for(device: torch.device) -> None:
    """CUDA: let cuDNN pick the fastest kernels for the (fixed) input shapes."""
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True


def memory_format(config: Config, device: torch.device) -> torch.memory_format:
    """--channels_last on CUDA; the default (contiguous) elsewhere."""
    return torch.channels_last if config.channels_last and device.type == "cuda" else torch.contiguous_format


def choose_device(name: str) -> torch.device:
    """`cpu`, or `cuda:0` (the one GPU a container sees); UsageError when there is none."""
    if name == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(
                "--device cuda: no CUDA GPU is visible to this process "
                "(torch.cuda.is_available() is False); use --device cpu"
            )
        return torch.device("cuda:0")
    return torch.device("cpu")


def gpu_identity(device: torch.device) -> dict[str, str]:
    """The GPU a process trains on, for its metrics' `join` record: {gpu: name, gpu_uuid:
    GPU-<uuid> as nvidia-smi -L prints it}; empty on CPU."""
    if device.type != "cuda":
        return {}
    p = torch.cuda.get_device_properties(device)
    return {"gpu": p.name, "gpu_uuid": f"GPU-{p.uuid}"}


def handle_sigterm(grace: float, announce: bool = True) -> None:
    """SIGTERM ends the process even as PID 1 and even while blocked inside torch.

    Python runs signal handlers only between bytecodes of the main thread,
    which may sit in a C++ wait (rendezvous, an RPC). The handler raises
    SystemExit for the normal path; a watcher thread, woken through the
    signal wakeup fd, ends the process with 143 if it is still alive `grace`
    seconds later (`announce`: it says so in one line as the signal comes).
    While `sigterm_exits_at_once` holds a line, the watcher ends the process
    at once with that line and status 0 instead.
    """
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    signal.signal(signal.SIGTERM, _raise_exit)
    threading.Thread(
        target=_exit_after_sigterm, args=(read_fd, grace, announce), name="sigterm-watch", daemon=True
    ).start()


class _Sigterm:
    deferring = False  # inside `sigterm_deferred`
    pending = False  # a SIGTERM came meanwhile
    received = False  # a SIGTERM came at all
    at_once = ""  # `sigterm_exits_at_once`'s line
    lock = threading.Lock()  # `at_once` against the watcher's reading of it


def _raise_exit(signum: int, frame: FrameType | None) -> None:
    _Sigterm.received = True
    if _Sigterm.deferring or _Sigterm.at_once:  # the watcher ends the process (at_once) or the block raises
        _Sigterm.pending = True
        return
    raise SystemExit(128 + signum)


def sigterm_received() -> bool:
    """Whether this process was told to stop (SIGTERM)."""
    return _Sigterm.received


def sigterm_exits_at_once(line: str) -> None:
    """From now on a SIGTERM ends the process at once with status 0 and `line` (logged), even
    while the main thread waits inside torch: for a stretch with nothing to hand over or undo
    (a worker that has not joined its job yet). '' ends that stretch; a SIGTERM that came in
    it and did not end the process raises SystemExit here (or at the end of the enclosing
    `sigterm_deferred`)."""
    with _Sigterm.lock:
        _Sigterm.at_once = line
    if not line and _Sigterm.pending and not _Sigterm.deferring:
        _Sigterm.pending = False
        raise SystemExit(128 + signal.SIGTERM)


@contextmanager
def sigterm_deferred() -> Iterator[None]:
    """A SIGTERM during the block takes effect (SystemExit) at its end, so the block's
    state changes happen all or none (a step and the step count that labels it).
    The watcher thread's hard exit still comes `grace` seconds after the signal."""
    _Sigterm.deferring = True
    try:
        yield
    finally:
        _Sigterm.deferring = False
        if _Sigterm.pending:
            _Sigterm.pending = False
            raise SystemExit(128 + signal.SIGTERM)


def _exit_after_sigterm(read_fd: int, grace: float, announce: bool) -> None:
    while signal.SIGTERM not in os.read(read_fd, 64):
        pass
    _Sigterm.received = True
    with _Sigterm.lock:
        if _Sigterm.at_once:
            log.info("%s", _Sigterm.at_once)
            exit_now(0)
    if announce:
        log.info("SIGTERM: stopping (at most %.0f s)", grace)
    time.sleep(grace)
    _hard_exit(f"still running {grace:.0f} s after SIGTERM", 128 + signal.SIGTERM)


@contextmanager
def deadline(seconds: float, what: str) -> Iterator[None]:
    """End the process with status 1 and one line if the block outlives `seconds`."""
    timer = threading.Timer(seconds, _hard_exit, args=(f"{what} did not finish within {seconds:.0f} s", 1))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


_CLEANUPS: list[Callable[[], None]] = []


def on_exit(cleanup: Callable[[], None]) -> None:
    """Run `cleanup` when this process ends, however it ends short of SIGKILL: its role
    returning or raising (app.__main__), SIGTERM, or `exit_now`'s hard exit."""
    _CLEANUPS.append(cleanup)


def run_cleanups() -> None:
    """Run the `on_exit` cleanups, newest first, each once; a failing one is logged."""
    while _CLEANUPS:
        cleanup = _CLEANUPS.pop()
        try:
            cleanup()
        except Exception as error:  # the process is ending: say it, and go on with the others
            log.warning("cleanup at exit failed: %s", first_line(error))


def _hard_exit(message: str, status: int) -> None:
    log.error("%s; exiting with status %d", message, status)
    exit_now(status)


def exit_now(status: int) -> None:
    """End the process at once, its `on_exit` cleanups run and logs and stdout flushed (no
    interpreter teardown)."""
    run_cleanups()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
