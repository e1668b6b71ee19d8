"""The RPC calls a worker makes to a PS process, by name: the one place both sides import.

RPC sends a call as its function's qualified name, so the caller and the callee must import the
same function. These are those functions; each hands its call to the `Service` the PS process
serves (an app.ps.rpc Endpoint, which installs itself with `serving` while it serves), so a
worker imports this module and the wire types, never the PS's code. `serving`'s table is the
process's one: the calls between the PS's own processes (app.ps.rpc) find their endpoint there
too (`service`). A call to a process that serves nothing raises (RPC hands the error back to
the caller).

- `rpc_join`: a worker process starts: the state, its rank's progress (Joined), or Taken /
  NotReady; with the PS process's shared-memory offer where it has one.
- `rpc_push`: a push; its message is a tensor (over the socket) or an InSlot (the worker's push
  slot of the PS process's segment that holds it), and the PS resolves which. It is
  `async_execution`: the answer (Reply, SlotReply or Refusal) may be held back (ssp, sync).
- `rpc_pull`, `rpc_finish`, `rpc_leave` (scaled down), `rpc_share` (what the rank trains next,
  in a job that may be scaled).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

import torch
from torch.futures import Future

from app.exchange.transport import answered_later, at_once, served
from app.exchange.wire import InSlot, Joined, NotReady, Push, Refusal, Share, Taken


class Service(Protocol):
    """What a PS process serves its workers (app.ps.rpc.Endpoint)."""

    def join(self, rank: int, name: str) -> Joined | Taken | NotReady: ...
    def pull(self, rank: int) -> tuple[torch.Tensor, int]: ...
    def push(self, message: torch.Tensor | InSlot, push: Push) -> Future: ...
    def finish(self, rank: int, pushes: int, name: str) -> Refusal | None: ...
    def leave(self, rank: int, pushes: int, name: str) -> Refusal | None: ...
    def share(self, rank: int, finished: Share | None) -> Share | None: ...


_SERVING: list[Service] = []  # the service of this process while it serves (at most one)


@contextmanager
def serving(service: Service) -> Iterator[None]:
    """Answer the calls below with `service` while the block runs."""
    _SERVING.append(service)
    try:
        yield
    finally:
        _SERVING.remove(service)


def service() -> Service:
    """What this process serves; RuntimeError when it serves nothing."""
    if not _SERVING:
        raise RuntimeError("no parameter server is serving in this process")
    return _SERVING[-1]


@served
def rpc_join(rank: int, name: str) -> Joined | Taken | NotReady:
    return service().join(rank, name)


@served
def rpc_pull(rank: int) -> tuple[torch.Tensor, int]:
    return service().pull(rank)


def proven_in_slot(message: torch.Tensor | InSlot, push: Push) -> bool:
    """A push through shared memory of float32 values its worker proved finite: its PS only
    takes its lock and steps (no check, no widening first), so the call is answered on the
    transport's I/O thread as it arrives (app.exchange.transport.at_once)."""
    return isinstance(message, InSlot) and message.dtype == "float32" and push.finite is True


@at_once(proven_in_slot)
@answered_later
def rpc_push(message: torch.Tensor | InSlot, push: Push) -> Future:
    """A Future of the Reply (or Refusal): ssp and sync answer once the others have caught up. A
    message in a push slot (a worker on the PS's host) is answered with the region that holds
    the new state (a SlotReply). Any other error is raised here, and RPC hands it to the caller
    as an error."""
    return service().push(message, push)


@served
def rpc_finish(rank: int, pushes: int, name: str = "") -> Refusal | None:
    return service().finish(rank, pushes, name)


@served
def rpc_leave(rank: int, pushes: int, name: str = "") -> Refusal | None:
    """A worker scaled down leaves the job for good (after its last push)."""
    return service().leave(rank, pushes, name)


@served
def rpc_share(rank: int, finished: Share | None = None) -> Share | None:
    """What rank trains next, having trained `finished` (None: its process starts); None: nothing
    is left (app.ps.members.epochs)."""
    return service().share(rank, finished)
