"""The PS's upkeep of the RPC group's member list in its store (app.exchange.group).

A joining process calls every member listed in the store; one dead member makes the join fail
and leaves the store's join/leave token held for good. So the PS takes each worker off that list
as soon as it registers (`unlist`): joiners only ever call the PS. If a joiner dies holding the
token anyway, `release_stuck_token` frees it.

Store calls run while holding the GIL, so nothing here blocks in `store.wait`: the token is
polled with short sleeps.
"""

from __future__ import annotations

import logging
import os
import time

import torch.distributed as dist

from app.exchange import transport

log = logging.getLogger("app.membership")
TOKEN_KEY = "RpcGroupManagementToken"  # the name torch RPC's own _utils give it
LISTING_KEY = "_ALL_WORKER_INFOS"  # "name-id,name-id," under the agent's "names/" prefix
POLL_SECONDS = 0.05


def _stores() -> tuple[dist.Store, dist.Store]:
    return transport.stores()


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
