"""Joining and leaving a running job: a process's name, its wait for the PS, its notes in the job's
store (app.exchange.transport.store), and `pong`, which the PS calls to see that it is alive.

A process's name is its connection's identity, and the PS reaches each process over that
connection alone. Each process of a rank joins under a name of its own (`claim_identity`:
`worker1`, then `worker1_r2`, ... drawn from the job's store), so the PS tells a restarted
worker from the process it replaces, and a late answer of the old one is never taken for the
new one's.

This module is what a joining process (worker or PS shard) does, and `pong`, which the PS calls
to see that a process is alive.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Callable
from typing import NoReturn

from app.config import Config, UsageError
from app.contract import PS, ps_name, worker_name
from app.exchange import transport
from app.runtime import machine, words

log = logging.getLogger("app.membership")
GIVE_UP_POLL_SECONDS = 5.0  # wait_for_ps asks whether to give up this often
READY_KEY = "psc/shards_ready"  # in the main PS's store once every shard registered (app.ps.sharding)
NOT_JOINING_KEY = "psc/not_joining/"  # + rank: its process ended cleanly before it joined (say_not_joining)
NOT_JOINING_SECONDS = 5.0  # how long a process on its way out tries to say so
SHAPE_KEY = "psc/model_shape"  # the main PS's model's input channels and classes (say_shape)
SHAPE_WAIT_SECONDS = 2.0  # how long a worker looks for them in a PS that has just started
MISTAKE_KEY = "psc/mistake"  # a worker's one line of a mistake the whole job shares: the PS stops on it too


class StoreUnreachable(RuntimeError):
    """The PS's store did not answer within the timeout (no PS, or a frozen one)."""


def where(config: Config) -> str:
    """The main PS's address, for people: its UNIX socket, or host:port."""
    if config.socket_dir:
        return os.path.join(config.socket_dir, f"{PS}.sock")
    return f"{config.master_addr}:{config.master_port}"


def wait_for_ps(config: Config, timeout: float, given_up: Callable[[], bool] = lambda: False, who: str = "") -> bool:
    """Until the PS listens, up to `timeout` (--join_timeout): a process (re)started before its
    PS (a PS restarted beside it, a loaded host) waits for it, instead of exiting and being
    restarted, which costs a whole start on a host that is busy starting the PS. `given_up()` is
    asked every few seconds meanwhile (a worker: the run has ended); False when it said so.
    StoreUnreachable after `timeout`."""
    deadline = time.monotonic() + timeout
    told = False
    while True:
        try:
            transport.wait_for_ps(config, max(0.1, min(GIVE_UP_POLL_SECONDS, deadline - time.monotonic())))
            return True
        except machine.PortUnreachable as error:
            if given_up():
                return False
            if time.monotonic() >= deadline:
                raise StoreUnreachable(
                    f"cannot reach the parameter server at {where(config)} within {timeout:.0f} s "
                    f"(--join_timeout): {error}"
                ) from None
            if not told:
                log.info(
                    "%swaiting for the parameter server at %s (%s; up to %.0f s, --join_timeout)",
                    f"{who}: " if who else "",
                    where(config),
                    error,
                    timeout,
                )
                told = True


def claim_identity(config: Config) -> tuple[str, int]:
    """This worker process's (RPC name, RPC id), new for every process of its rank."""
    incarnation, rpc_id = _claim(f"psc/incarnation/{config.rank}", config)
    return incarnation_name(config.rank, incarnation), rpc_id


def claim_shard_identity(config: Config) -> tuple[str, int]:
    """A PS shard's (RPC name, RPC id): `ps<index>`, then `ps<index>_r2`, ... (app.ps.sharding.slices)."""
    incarnation, rpc_id = _claim(f"psc/incarnation/ps{config.shard}", config)
    return shard_name(config.shard, incarnation), rpc_id


def _claim(key: str, config: Config) -> tuple[int, int]:
    """(incarnation under `key`, a fresh RPC id), both drawn from the PS's store."""
    timeout = config.rpc_timeout
    try:
        transport.wait_for_ps(config, timeout)
        with transport.store(config, timeout) as store:
            return store.add(key, 1), store.add("psc/rpc_ids", 1)
    except (machine.PortUnreachable, RuntimeError, ValueError) as error:  # DistError subclasses RuntimeError
        raise StoreUnreachable(
            f"cannot reach the parameter server at {where(config)} within {timeout:.0f} s: {words.first_line(error)}"
        ) from None


def say_not_joining(config: Config, timeout: float = NOT_JOINING_SECONDS) -> bool:
    """Tell the PS that this process of config.rank ends cleanly (scaled down, or its code exited
    0) before it joined: the PS stops waiting for the rank (app.ps.members.liveness), instead of
    holding the run for --join_timeout. A note in the PS's store (the process is in no session
    yet); best effort: False when the store did not take it within `timeout` (no PS yet: it then
    waits for the rank as for any that has not joined)."""
    try:
        transport.wait_for_ps(config, timeout)
        with transport.store(config, timeout) as store:
            store.set(f"{NOT_JOINING_KEY}{config.rank}", str(os.getpid()))
        return True
    except (machine.PortUnreachable, RuntimeError, ValueError):  # DistError subclasses RuntimeError
        return False


def say_ps_mistake(store: transport.KeyValues, line: str) -> NoReturn:
    """A mistake the main PS found before any worker joined (`line`): every worker stops on it
    too (check_shape reads it), and so does the PS (UsageError)."""
    store.set(MISTAKE_KEY, line)
    raise UsageError(line)


def say_shape(store: transport.KeyValues, channels: int, num_classes: int) -> None:
    """The main PS's note of the model it built from its held-out split: what every worker's
    training split must give too (check_shape)."""
    store.set(SHAPE_KEY, json.dumps({"channels": channels, "num_classes": num_classes}))


def check_shape(config: Config, channels: int, num_classes: int, timeout: float) -> None:
    """Before this worker joins: UsageError, one line naming what differs, when its training split
    gives another num_classes or channels than the held-out split the PS built its model from
    (their states could not be exchanged: the values differ in number). The PS is told the rank
    is not joining, so it does not wait for it. Nothing to check with a PS that has not said."""
    deadline = time.monotonic() + SHAPE_WAIT_SECONDS
    with transport.store(config, timeout) as store:
        said, wrong = store.get(SHAPE_KEY), mistake(store)
        while said is None and not wrong and time.monotonic() < deadline:
            time.sleep(0.05)
            said, wrong = store.get(SHAPE_KEY), mistake(store)
    if wrong:  # the PS stopped on a mistake of the job's: this worker stops on it too
        raise UsageError(wrong)
    if said is None:
        return
    ps = json.loads(said)
    mine = {"channels": channels, "num_classes": num_classes}
    differ = [k for k in ("num_classes", "channels") if ps.get(k) != mine[k]]
    if differ:
        what = ", ".join(f"{k} {mine[k]}" for k in differ)
        theirs = ", ".join(f"{k} {ps.get(k)}" for k in differ)
        line = (
            f"the training split gives {what}; the held-out split the PS built its model from gives {theirs}: "
            "both splits must agree (a vocabulary or a class list built from both, or the training one for both)"
        )
        say_mistake(config, line, timeout)


def say_mistake(config: Config, line: str, timeout: float) -> NoReturn:
    """A mistake every worker would meet (`line`): the PS is told, and stops on it too (exit 2, the
    same line); this rank is not joining; UsageError."""
    with transport.store(config, timeout) as store:
        store.set(MISTAKE_KEY, line)
    say_not_joining(config)
    raise UsageError(line)


def mistake(store: transport.KeyValues) -> str:
    """The mistake a worker found that the whole job shares (check_shape); '' when none."""
    said = store.get(MISTAKE_KEY)
    return said.decode(errors="replace") if said else ""


def not_joining(store: transport.KeyValues, ranks: list[int]) -> list[int]:
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


@transport.served
def pong() -> int:
    """What the PS calls to see that a worker is alive."""
    return os.getpid()
