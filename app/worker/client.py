"""The worker's side of the PS's RPC calls (app.exchange.calls): join, push, finish, leave, shard.

A push goes through the PS's shared memory when the worker could map it at join
(app.exchange.worker_end: the message in a push slot, RPC carries only which one), else over
TensorPipe as a tensor; either way the answer is a Reply (or a Refusal).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed.rpc as rpc

from app.config import UsageError
from app.contract import PS, worker_name
from app.exchange import calls
from app.exchange.wire import Joined, NotReady, Push, Refusal, Refused, Reply, SlotReply, Start, Taken, Version
from app.exchange.worker_end import SharedLink, attach
from app.runtime import first_line

NOT_IN_GROUP_YET = "could not find destination name"


class Pending(Protocol):
    """A push on the wire: `wait()` gives the PS's answer."""

    def wait(self) -> Reply | Refusal: ...


class PSUnreachable(RuntimeError):
    """A call to the PS failed (it died, or did not answer within rpc_timeout)."""


def call_joining(to: str, function: Callable[..., Any], args: tuple[Any, ...], timeout: float) -> Any:
    """`rpc.rpc_sync` of a worker's join to `to` (the PS or a shard). A worker can enter the RPC
    group before `to` has (the PS hosts the group's store, then enters it): `to` tells every
    member of itself as it enters, and until then RPC cannot find its name, so the call is tried
    again every 0.1 s, within `timeout`; any other error, or that one past `timeout`, raises."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return rpc.rpc_sync(to, function, args=args, timeout=timeout)
        except RuntimeError as error:
            if NOT_IN_GROUP_YET not in str(error) or time.monotonic() >= deadline:
                raise
            time.sleep(0.1)


class PSClient:
    """The worker's side of the PS's RPC functions; every call bounded by rpc_timeout
    (a push under ssp or sync may also wait `push_wait` for the slowest worker).
    `exchange`: auto (shared memory where the PS offers it and this process can map it)
    or tensorpipe."""

    def __init__(
        self,
        rank: int,
        timeout: float,
        address: str,
        name: str = "",
        push_wait: float = 0.0,
        exchange: str = "auto",
        device: torch.device | None = None,
    ) -> None:
        self.rank, self.timeout, self.address = rank, timeout, address
        self.name = name or worker_name(rank)
        self.push_timeout = timeout + push_wait
        self.exchange, self.device = exchange, device or torch.device("cpu")
        self.link: SharedLink | None = None

    def join(self) -> Start:
        """The state to start from and this rank's progress; UsageError if the rank is taken.
        Maps the PS's shared memory when it offers it (`link`)."""
        joined = self.admitted()
        return Start(joined.vector, joined.version, joined.progress)

    def admitted(self) -> Joined:
        """The main PS's answer to this process's join (the shards' names too, when it has
        shards), its shared memory mapped; UsageError if the rank is taken, PSUnreachable if
        the PS cannot be reached or its shards are not all up."""
        try:
            answer = call_joining(PS, calls.rpc_join, (self.rank, self.name), self.timeout)
        except RuntimeError as error:
            raise self.lost(calls.rpc_join, error) from error
        if isinstance(answer, Taken):
            raise UsageError(answer.message)
        if isinstance(answer, NotReady):  # a shard restarts: start again once it is back
            raise self.lost(calls.rpc_join, RuntimeError(answer.message))
        self.link = attach(answer.exchange, self.rank, self.device, self.exchange, self.name, PS)
        return answer

    def message_buffers(self) -> list[torch.Tensor] | None:
        """Where the worker may write its messages so that a push copies nothing: the push
        slots in the PS's shared memory (None over TensorPipe)."""
        return self.link.slots if self.link is not None else None

    def reply_buffers(self) -> list[torch.Tensor]:
        """Where the PS's replies may be: its reply buffers in shared memory ([] over TensorPipe,
        where every reply is a new tensor)."""
        return self.link.replies if self.link is not None else []

    def pull(self) -> tuple[torch.Tensor, int]:
        return self._call(calls.rpc_pull, self.rank)

    def push(
        self,
        message: torch.Tensor,
        version: Version,
        epoch: int = 1,
        batch: int = 0,
        samples: int = 0,
        noted: tuple[int, bool] | None = None,
        placed: int | None = None,
    ) -> Reply | Refusal:
        return self.push_async(message, version, epoch, batch, samples, noted, placed).wait()

    def push_async(
        self,
        message: torch.Tensor,
        version: Version,
        epoch: int = 1,
        batch: int = 0,
        samples: int = 0,
        noted: tuple[int, bool] | None = None,
        placed: int | None = None,
    ) -> PendingPush:
        """Send a push now; `.wait()` on the result gives the Reply. Through shared memory:
        `noted`, (the backward the gradient comes from, whether its partitions were noted ahead:
        app.exchange.early_push); `placed`, the slot the message is already in (a GPU worker copied
        it there)."""
        try:
            assert isinstance(version, int)  # one PS process's
            push = Push(self.rank, self.name, version, epoch, batch, samples)
            if self.link is not None:
                slot = placed if placed is not None else self.link.place(message)
                dtype = str(message.dtype).removeprefix("torch.")
                push = push._replace(backward=noted[0], noted=noted[1]) if noted is not None else push
                args: tuple[Any, ...] = (slot, dtype, message.numel(), push)
                future = rpc.rpc_async(PS, calls.rpc_push_slot, args=args, timeout=self.push_timeout)
            else:
                future = rpc.rpc_async(PS, calls.rpc_push, args=(message, push), timeout=self.push_timeout)
        except RuntimeError as error:
            raise self.lost(calls.rpc_push, error) from error
        return PendingPush(self, future, message)

    def finish(self, pushes: int) -> None:
        refused(self._call(calls.rpc_finish, self.rank, pushes, self.name))

    def leave(self, pushes: int) -> None:
        """Leave the job for good (scaled down): the PS stops waiting for this rank."""
        refused(self._call(calls.rpc_leave, self.rank, pushes, self.name))

    def shard(self) -> tuple[int, int]:
        """(index, count): this rank's share of the next epoch among the ranks training now."""
        return tuple(self._call(calls.rpc_shard, self.rank))

    def _call(self, function: Callable[..., Any], *args: Any) -> Any:
        try:
            return rpc.rpc_sync(PS, function, args=args, timeout=self.timeout)
        except RuntimeError as error:
            raise self.lost(function, error) from error

    def lost(self, function: Callable[..., Any], error: BaseException) -> PSUnreachable:
        """The error to raise when `function` failed: the PS is gone, or did not answer in time."""
        return PSUnreachable(
            f"lost the parameter server at {self.address} during {function.__name__}: {first_line(error)}"
        )


def refused(answer: Any) -> Any:
    """The PS's answer, unless it refused because a newer process replaced this one
    (UsageError: exit 2); a `nonfinite` Refusal is returned for the caller to skip."""
    if isinstance(answer, Refusal) and answer.kind is Refused.STALE:
        raise UsageError(answer.message)
    return answer


class PendingPush:
    """A push on the wire; holds its message until the reply came (RPC sends from it)."""

    def __init__(self, client: PSClient, future: Any, message: torch.Tensor) -> None:
        self.client, self.future, self.message = client, future, message

    def wait(self) -> Reply | Refusal:
        try:
            answer = self.future.wait()
        except RuntimeError as error:
            raise self.client.lost(calls.rpc_push, error) from error
        if isinstance(answer, SlotReply) and self.client.link is not None:
            return self.client.link.reply(answer)
        return refused(answer)
