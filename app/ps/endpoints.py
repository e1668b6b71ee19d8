"""The RPC entry points of a PS process (`rpc_*`) and where they find what it serves.

RPC runs plain functions by name, so what a process serves has to be reachable
from them: `ENDPOINT` is the app's one piece of process-wide state, set only
for the duration of `serving()` (its parts: `serving_main`, `serving_shard`).

- Every PS process (the main PS and each shard): `rpc_join`, `rpc_pull`,
  `rpc_push`, `rpc_push_slot` (a push through shared memory, app.ps.exchange),
  `rpc_finish`, `rpc_leave`, `rpc_shard` (workers call them), `rpc_drop` (the main
  PS forwards a worker's drop to the shards).
- The main PS of a sharded PS: `rpc_register`, `rpc_resumed` (shards call them).
- A shard: `rpc_checkpoint`, `rpc_end` (the main PS calls them).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Optional

import torch
import torch.distributed.rpc as rpc
from torch.futures import Future

from app.common.wire import Joined, NotReady, Push, Refusal, Taken
from app.ps.server import ParameterServer
from app.ps.speculation import NoteReader

Admit = Callable[[int, str], "Joined | Taken | NotReady"]  # (rank, name) -> the answer to a join
Register = Callable[[int, str, int, tuple[int, int]], "str | None"]  # a shard announces itself
Resumed = Optional[tuple[int, str]]  # the main PS's newest checkpoint: (version, its run id); None: none yet
SaveLabelled = Callable[[int], "str | None"]  # a shard writes its checkpoint labelled V


class Endpoint:
    """What this process serves; set while it serves, None otherwise."""

    def __init__(self) -> None:
        self.server: ParameterServer | None = None
        self.join: Admit | None = None  # app.ps.liveness.LivenessMonitor.join on the main PS
        self.register: Register | None = None  # the main PS of a sharded PS: ShardSet.register
        self.resumed: Callable[[], Resumed] = lambda: None  # ... and its newest checkpoint (version, run id)
        self.save_labelled: SaveLabelled | None = None  # a shard's checkpoint writer
        self.ended = threading.Event()  # a shard: the main PS said training ended
        self.finished = False  # ... and whether every worker finished

    @contextmanager
    def serving(self, server: ParameterServer, join: Admit | None = None) -> Iterator[ParameterServer]:
        """Serve `server`: its RPC entry points, and the notes of its bell where it has one
        (a thread of their own, app.ps.speculation)."""
        self.server, self.join = server, join
        bell = server.shared.bell if server.shared is not None and server.parts is not None else None
        notes = NoteReader(bell, server.ahead) if bell is not None else None
        try:
            yield server
        finally:
            if notes is not None:
                notes.close()
            self.server, self.join = None, None

    @contextmanager
    def serving_main(self, register: Register | None, resumed: Callable[[], Resumed] = lambda: None) -> Iterator[None]:
        """The main PS: shards register through `register` (None: --shards 1) and resume from
        the checkpoint labelled `resumed()`: the main PS's newest, the one it resumed from or
        wrote since (None: none yet, a new run), so a shard restarted mid-run gets its slice
        back from the last checkpoint rather than the initial values."""
        self.register, self.resumed = register, resumed
        try:
            yield
        finally:
            self.register, self.resumed = None, lambda: None

    @contextmanager
    def serving_shard(self, save_labelled: SaveLabelled) -> Iterator[None]:
        """A shard: the main PS asks it to checkpoint through `save_labelled`."""
        self.save_labelled = save_labelled
        try:
            yield
        finally:
            self.save_labelled = None

    def get(self) -> ParameterServer:
        if self.server is None:
            raise RuntimeError("no parameter server is serving in this process")
        return self.server


ENDPOINT = Endpoint()


def rpc_join(rank: int, name: str) -> Joined | Taken | NotReady:
    """A worker process starts: the state to start from and its rank's progress (Joined; Taken
    when another process holds the rank), and where this PS process has one, its
    shared-memory segment (`exchange`: an Offer the worker maps when it is on this host)."""
    server = ENDPOINT.get()
    answer = ENDPOINT.join(rank, name) if ENDPOINT.join is not None else server.join(rank, name)
    if server.shared is not None and isinstance(answer, Joined):
        return answer._replace(exchange=server.shared.offer(answer.life))
    return answer


def rpc_pull(rank: int) -> tuple[torch.Tensor, int]:
    return ENDPOINT.get().pull(rank)


@rpc.functions.async_execution
def rpc_push(message: torch.Tensor, push: Push) -> Future:
    """A Future of the Reply (or Refusal): ssp and sync answer once the others have caught up.
    Any other error is raised here, and RPC hands it to the caller as an error."""
    return _submit(ENDPOINT.get(), message, push)


@rpc.functions.async_execution
def rpc_push_slot(slot: int, dtype: str, numel: int, push: Push) -> Future:
    """rpc_push for a worker on this host: its message is in its push slot `slot` of this PS
    process's segment (`numel` values of `dtype`); the answer names the region that holds the
    new state (a SlotReply), or is a Refusal."""
    server = ENDPOINT.get()
    shared = server.shared
    if shared is None:
        raise RuntimeError("this parameter server has no shared-memory segment")
    message = shared.push(push.rank, slot, dtype, numel)
    return _submit(server, message, push).then(lambda done: shared.answer(done.value()))


def _submit(server: ParameterServer, message: torch.Tensor, push: Push) -> Future:
    """`server.submit` of `message` with what `push` says of it."""
    return server.submit(
        push.rank,
        message,
        push.pulled,
        push.name,
        push.epoch,
        push.batch,
        push.samples,
        push.staleness,
        push.backward,
        push.noted,
    )


def rpc_finish(rank: int, pushes: int, name: str = "") -> Refusal | None:
    return ENDPOINT.get().finish(rank, pushes, name)


def rpc_leave(rank: int, pushes: int, name: str = "") -> Refusal | None:
    """A worker scaled down leaves the job for good (after its last push)."""
    return ENDPOINT.get().leave(rank, pushes, name)


def rpc_shard(rank: int) -> tuple[int, int]:
    """(index, count): rank's share of the next epoch's data among the ranks training now."""
    return ENDPOINT.get().shard_of(rank)


def rpc_drop(rank: int, name: str) -> bool:
    return ENDPOINT.get().drop(rank, name)


def rpc_resumed() -> tuple[int, str] | None:
    """The main PS's newest checkpoint, (version, run id), which a (re)starting shard resumes
    from (None: none yet)."""
    return ENDPOINT.resumed()


def rpc_register(index: int, name: str, k: int, part: tuple[int, int]) -> str | None:
    """A shard announces itself to the main PS; an error line, or None."""
    if ENDPOINT.register is None:
        return "the main parameter server runs with --shards 1"
    return ENDPOINT.register(index, name, k, part)


def rpc_checkpoint(version: int) -> str | None:
    """Write this shard's checkpoint labelled `version`; an error line, or None."""
    if ENDPOINT.save_labelled is None:
        return "this shard is not serving yet"
    return ENDPOINT.save_labelled(version)


def rpc_end(finished: bool) -> None:
    """Training ended (`finished`: every worker finished): the shard saves and exits."""
    ENDPOINT.finished = finished
    ENDPOINT.ended.set()
