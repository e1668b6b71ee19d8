"""Joining and leaving a running job: torch RPC's dynamic membership, made crash-safe.

The job is a dynamic RPC group (`init_rpc(world_size=None)`): the PS (RPC id
0) starts it and holds its TCP store; workers join and leave at any time.
On torch 2.13 three things break it after a crash, and each has
its answer here:

- Names and ids must be new for each process: a worker that rejoins under
  its old name breaks calls to it. `claim_identity` draws them from the
  store: `worker1` first, then `worker1_r2`, ... (no '-': torch splits its
  member list on it), and a fresh RPC id every time.
- A joining process calls every member listed in the store; one dead member
  makes the join fail and leaves the store's join/leave token held for
  good. So the PS takes each worker off that list as soon as it registers
  (app.ps.members.listing): joiners only ever call the PS. If a joiner dies
  holding the token anyway, the PS frees it.
- A graceful leave calls every member and takes that token too: processes
  leave with `rpc.shutdown(graceful=False)` (app.exchange.transport.session).

This module is what a joining process (worker or PS shard) does, and `pong`, which the PS calls
to see that a process is alive.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from app.contract import ps_name, worker_name
from app.runtime import machine, words

log = logging.getLogger("app.membership")
GIVE_UP_POLL_SECONDS = 5.0  # wait_for_ps asks whether to give up this often
READY_KEY = "psc/shards_ready"  # in the main PS's store once every shard registered (app.ps.sharding)
NOT_JOINING_KEY = "psc/not_joining/"  # + rank: its process ended cleanly before it joined (say_not_joining)
NOT_JOINING_SECONDS = 5.0  # how long a process on its way out tries to say so


class StoreUnreachable(RuntimeError):
    """The PS's store did not answer within the timeout (no PS, or a frozen one)."""


def wait_for_port(host: str, port: int, timeout: float) -> None:
    """Until the PS's store accepts connections (torch's own retry logs a C++ stack trace)."""
    try:
        machine.wait_for_port(host, port, timeout)
    except machine.PortUnreachable as error:
        raise StoreUnreachable(
            f"cannot reach the parameter server at {host}:{port} within {timeout:.0f} s: {error}"
        ) from None


def wait_for_ps(
    host: str, port: int, timeout: float, given_up: Callable[[], bool] = lambda: False, who: str = ""
) -> bool:
    """Until the PS's store accepts connections, up to `timeout` (--join_timeout): a process
    (re)started before its PS (a PS restarted beside it, a loaded host) waits for it, instead of
    exiting and being restarted, which costs a whole start on a host that is busy starting the PS.
    `given_up()` is asked every few seconds meanwhile (a worker: the run has ended); False when
    it said so. StoreUnreachable after `timeout`."""
    deadline = time.monotonic() + timeout
    told = False
    while True:
        try:
            machine.wait_for_port(host, port, max(0.1, min(GIVE_UP_POLL_SECONDS, deadline - time.monotonic())))
            return True
        except machine.PortUnreachable as error:
            if given_up():
                return False
            if time.monotonic() >= deadline:
                raise StoreUnreachable(
                    f"cannot reach the parameter server at {host}:{port} within {timeout:.0f} s "
                    f"(--join_timeout): {error}"
                ) from None
            if not told:
                log.info(
                    "%swaiting for the parameter server at %s:%d (%s; up to %.0f s, --join_timeout)",
                    f"{who}: " if who else "",
                    host,
                    port,
                    error,
                    timeout,
                )
                told = True


def claim_identity(rank: int, master_addr: str, master_port: int, timeout: float) -> tuple[str, int]:
    """This process's (RPC name, RPC id), new for every process of a rank."""
    incarnation, rpc_id = _claim(f"psc/incarnation/{rank}", master_addr, master_port, timeout)
    return incarnation_name(rank, incarnation), rpc_id


def claim_shard_identity(index: int, master_addr: str, master_port: int, timeout: float) -> tuple[str, int]:
    """A PS shard's (RPC name, RPC id): `ps<index>`, then `ps<index>_r2`, ... (app.ps.sharding.slices)."""
    incarnation, rpc_id = _claim(f"psc/incarnation/ps{index}", master_addr, master_port, timeout)
    return shard_name(index, incarnation), rpc_id


def _claim(key: str, master_addr: str, master_port: int, timeout: float) -> tuple[int, int]:
    """(incarnation under `key`, a fresh RPC id), both drawn from the PS's store."""
    wait_for_port(master_addr, master_port, timeout)
    try:
        store = connect(master_addr, master_port, timeout)
        return store.add(key, 1), store.add("psc/rpc_ids", 1)
    except (RuntimeError, ValueError) as error:  # DistError subclasses RuntimeError
        raise StoreUnreachable(
            f"cannot reach the parameter server at {master_addr}:{master_port} "
            f"within {timeout:.0f} s: {words.first_line(error)}"
        ) from None


def connect(master_addr: str, master_port: int, timeout: float) -> dist.TCPStore:
    """A client of the PS's store."""
    return dist.TCPStore(master_addr, master_port, is_master=False, timeout=timedelta(seconds=timeout))


def say_not_joining(rank: int, master_addr: str, master_port: int, timeout: float = NOT_JOINING_SECONDS) -> bool:
    """Tell the PS that this process of `rank` ends cleanly (scaled down, or its code exited 0)
    before it joined: the PS stops waiting for the rank (app.ps.members.liveness), instead of
    holding the run for --join_timeout. A note in the PS's store, not an RPC (the process is in
    no group); best effort: False when the store did not take it within `timeout` (no PS yet:
    it then waits for the rank as for any that has not joined)."""
    try:
        machine.wait_for_port(master_addr, master_port, timeout)
        connect(master_addr, master_port, timeout).set(f"{NOT_JOINING_KEY}{rank}", str(os.getpid()))
        return True
    except (machine.PortUnreachable, RuntimeError, ValueError):  # DistError subclasses RuntimeError
        return False


def not_joining(store: dist.Store, ranks: list[int]) -> list[int]:
    """Of `ranks`, those a process said it will not join for (say_not_joining), each note taken
    off the store as it is read: it counts once."""
    said = [r for r in ranks if store.check([f"{NOT_JOINING_KEY}{r}"])]
    for r in said:
        store.delete_key(f"{NOT_JOINING_KEY}{r}")
    return said


def incarnation_name(rank: int, incarnation: int) -> str:
    return worker_name(rank) if incarnation == 1 else f"{worker_name(rank)}_r{incarnation}"


def shard_name(index: int, incarnation: int) -> str:
    return ps_name(index) if incarnation == 1 else f"{ps_name(index)}_r{incarnation}"


def is_shard_name(name: str) -> bool:
    """`ps1`, `ps2_r3`...: a PS shard, which stays on the store's member list (app.ps.sharding.slices)."""
    return re.fullmatch(r"ps\d+(_r\d+)?", name) is not None


def pong() -> int:
    """What the PS calls to see that a worker is alive."""
    return os.getpid()
