"""What a process takes of its host: its threads, its freed memory kept, the network interface, a port to wait for."""

from __future__ import annotations

import ctypes
import os
import socket
import time

import torch

from app.config import Config

LOOPBACK = ("localhost", "127.0.0.1", "::1")


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


def wait_for_socket(path: str, timeout: float, poll: float = 0.2) -> None:
    """Until the UNIX socket at `path` accepts a connection; PortUnreachable after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                probe.settimeout(max(0.1, min(2.0, deadline - time.monotonic())))
                probe.connect(path)
                return
        except OSError as error:
            reason = f"{path}: {error.strerror or error}"
        if time.monotonic() + poll >= deadline:
            raise PortUnreachable(reason)
        time.sleep(poll)


def set_gloo_interface(master_addr: str) -> None:
    """Gloo binds the interface of this host's name unless told: the loopback for a loopback
    master; an explicit GLOO_SOCKET_IFNAME (the render's network.ifname) wins."""
    if "GLOO_SOCKET_IFNAME" in os.environ:
        return
    if master_addr in LOOPBACK:
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"


# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_MAX = -1, -2, -4


def keep_freed_memory() -> bool:
    """Serve big tensors from the heap and keep freed memory for the next one.

    Every message the transport receives is a fresh tensor: with glibc's defaults an
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
