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
  (`unlist`): joiners only ever call the PS. If a joiner dies holding the
  token anyway, `release_stuck_token` frees it.
- A graceful leave calls every member and takes that token too: processes
  leave with `rpc.shutdown(graceful=False)` (app.runtime.rpc_session).

Store calls run while holding the GIL, so nothing here blocks in
`store.wait`: the token is polled with short sleeps.
"""

from __future__ import annotations

import logging
import os
import re
import time
from datetime import timedelta

import torch.distributed as dist
import torch.distributed.rpc as rpc

from app import runtime
from app.contract import ps_name, worker_name

log = logging.getLogger("app.membership")
TOKEN_KEY = "RpcGroupManagementToken"  # torch.distributed.rpc._utils
LISTING_KEY = "_ALL_WORKER_INFOS"  # "name-id,name-id," under the agent's "names/" prefix
POLL_SECONDS = 0.05


class StoreUnreachable(RuntimeError):
    """The PS's store did not answer within the timeout (no PS, or a frozen one)."""


def wait_for_port(host: str, port: int, timeout: float) -> None:
    """Until the PS's store accepts connections (torch's own retry logs a C++ stack trace)."""
    try:
        runtime.wait_for_port(host, port, timeout)
    except runtime.PortUnreachable as error:
        raise StoreUnreachable(
            f"cannot reach the parameter server at {host}:{port} within {timeout:.0f} s: {error}"
        ) from None


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
            f"within {timeout:.0f} s: {runtime.first_line(error)}"
        ) from None


def connect(master_addr: str, master_port: int, timeout: float) -> dist.TCPStore:
    """A client of the PS's store."""
    return dist.TCPStore(master_addr, master_port, is_master=False, timeout=timedelta(seconds=timeout))


def incarnation_name(rank: int, incarnation: int) -> str:
    return worker_name(rank) if incarnation == 1 else f"{worker_name(rank)}_r{incarnation}"


def shard_name(index: int, incarnation: int) -> str:
    return ps_name(index) if incarnation == 1 else f"{ps_name(index)}_r{incarnation}"


def is_shard_name(name: str) -> bool:
    """`ps1`, `ps2_r3`...: a PS shard, which stays on the store's member list (app.ps.sharding.slices)."""
    return re.fullmatch(r"ps\d+(_r\d+)?", name) is not None


def _stores() -> tuple[dist.Store, dist.Store]:
    agent = rpc.api._get_current_rpc_agent()
    if not isinstance(agent, rpc.TensorPipeAgent):  # the only RPC agent with a store
        raise RuntimeError(f"the membership store needs the TensorPipe RPC agent, not {type(agent).__name__}")
    return agent.store, dist.PrefixStore("names", agent.store)


def _take_token(store: dist.Store, mine: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while store.compare_set(TOKEN_KEY, "", mine).decode() != mine:
        if time.monotonic() > deadline:
            return False
        time.sleep(POLL_SECONDS)
    return True


def _give_token(store: dist.Store, mine: str) -> None:
    store.set(TOKEN_KEY, "")
    store.set(mine, "Done")  # what torch's waiters wait for


def unlist(names: list[str], timeout: float) -> bool:
    """Take `names` off the store's member list (on the PS); False if the token stayed busy."""
    store, listing_store = _stores()
    mine = f"Token_for_ps_unlist_{os.getpid()}"
    if not _take_token(store, mine, timeout):
        return False
    try:
        entries = listing_store.get(LISTING_KEY).decode().split(",")
        kept = [e for e in entries if e and e.rsplit("-", 1)[0] not in names]
        listing_store.set(LISTING_KEY, "".join(f"{e}," for e in kept))
    finally:
        _give_token(store, mine)
    return True


def listed() -> list[str]:
    """Names on the store's member list."""
    _, listing_store = _stores()
    entries = listing_store.get(LISTING_KEY).decode().split(",")
    return [e.rsplit("-", 1)[0] for e in entries if e]


def token_holder() -> str:
    store, _ = _stores()
    return store.get(TOKEN_KEY).decode() if store.check([TOKEN_KEY]) else ""


def release_stuck_token(holder: str) -> None:
    """Free the join/leave token of a process that died holding it."""
    store, _ = _stores()
    if store.compare_set(TOKEN_KEY, holder, "").decode() == "":
        store.set(holder, "Done")
        log.warning("released the RPC join token held by a process that died (%s)", holder)


def pong() -> int:
    """What the PS calls to see that a worker is alive."""
    return os.getpid()
