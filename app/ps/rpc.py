"""What a PS process serves over RPC, and the calls between the PS's own processes.

RPC runs plain functions by name, so what a process serves has to be reachable
from them: `ENDPOINT` is the app's one piece of process-wide state, set only
for the duration of `serving()` (its parts: `serving_main`, `serving_shard`).

- Every PS process (the main PS and each shard) serves the calls workers make
  (app.exchange.calls: join, pull, push (a tensor, or a push slot), finish, leave,
  share): `Endpoint` is that service, over the PS it is given (`Served`: what it calls of
  app.ps.server's ParameterServer, which this module does not import). `rpc_drop`: the main
  PS forwards a worker's drop to the shards.
- The main PS of a sharded PS: `rpc_register`, `rpc_resumed` (shards call them).
- A shard: `rpc_checkpoint`, `rpc_end` (the main PS calls them).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Optional, Protocol

import torch
from torch.futures import Future

from app.exchange import calls
from app.exchange.notes import Note, NoteReader
from app.exchange.ps_end import PSEnd
from app.exchange.wire import InSlot, Joined, NotReady, Push, Refusal, Share, Taken

Admit = Callable[[int, str], "Joined | Taken | NotReady"]  # (rank, name) -> the answer to a join
Register = Callable[[int, str, int, tuple[int, int]], "str | None"]  # a shard announces itself
Resumed = Optional[tuple[int, str]]  # the main PS's newest checkpoint: (version, its run id); None: none yet
SaveLabelled = Callable[[int], "str | None"]  # a shard writes its checkpoint labelled V


class Served(Protocol):
    """What the endpoints call of the PS they serve (app.ps.server.ParameterServer)."""

    @property
    def shared(self) -> PSEnd:
        """Its end of the exchange: its shared-memory segment, or NO_SEGMENT."""

    @property
    def partitions(self) -> Sequence[tuple[int, int]] | None:
        """The partitions it takes early (app.ps.early); None: none."""

    def join(self, rank: int, name: str) -> Joined: ...
    def pull(self, rank: int) -> tuple[torch.Tensor, int]: ...
    def submit(self, push: Push, message: torch.Tensor) -> Future: ...
    def note(self, note: Note) -> None: ...
    def finish(self, rank: int, pushes: int, name: str = "") -> Refusal | None: ...
    def leave(self, rank: int, pushes: int, name: str = "") -> Refusal | None: ...
    def share(self, rank: int, finished: Share | None = None) -> Share | None: ...
    def drop(self, rank: int, name: str) -> bool: ...


class Endpoint:
    """What this process serves; set while it serves, None otherwise."""

    def __init__(self) -> None:
        self.server: Served | None = None
        self.admit: Admit | None = None  # app.ps.members.liveness.LivenessMonitor.join on the main PS
        self.register: Register | None = None  # the main PS of a sharded PS: ShardSet.register
        self.resumed: Callable[[], Resumed] = lambda: None  # ... and its newest checkpoint (version, run id)
        self.save_labelled: SaveLabelled | None = None  # a shard's checkpoint writer
        self.ended = threading.Event()  # a shard: the main PS said training ended
        self.finished = False  # ... and whether every worker finished

    @contextmanager
    def serving(self, server: Served, join: Admit | None = None) -> Iterator[None]:
        """Serve `server`: its RPC entry points, and the notes on its note socket where it has one
        (a thread of their own, app.ps.early)."""
        self.server, self.admit = server, join
        inbox = server.shared.notes if server.partitions is not None else None
        notes = NoteReader(inbox, server.note) if inbox is not None else None
        try:
            with calls.serving(self):
                yield
        finally:
            if notes is not None:
                notes.close()
            self.server, self.admit = None, None

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

    def get(self) -> Served:
        if self.server is None:
            raise RuntimeError("no parameter server is serving in this process")
        return self.server

    # The calls workers make (app.exchange.calls.Service).

    def join(self, rank: int, name: str) -> Joined | Taken | NotReady:
        """A worker process starts: the state to start from and its rank's progress (Joined; Taken
        when another process holds the rank), and where this PS process has one, its
        shared-memory segment (`exchange`: an Offer the worker maps when it is on this host)."""
        server = self.get()
        answer = self.admit(rank, name) if self.admit is not None else server.join(rank, name)
        if isinstance(answer, Joined):
            return answer._replace(exchange=server.shared.offer(answer.life))
        return answer

    def pull(self, rank: int) -> tuple[torch.Tensor, int]:
        return self.get().pull(rank)

    def push(self, message: torch.Tensor | InSlot, push: Push) -> Future:
        """The push's message resolved: a tensor as it came, or the push slot that holds it (the
        answer then names the region of the new state)."""
        server = self.get()
        if not isinstance(message, InSlot):
            return server.submit(push, message)
        shared = server.shared  # NO_SEGMENT refuses the slot
        values = shared.push(push.rank, message.slot, message.dtype, message.numel)
        return server.submit(push, values).then(lambda done: shared.answer(done.value()))

    def finish(self, rank: int, pushes: int, name: str) -> Refusal | None:
        return self.get().finish(rank, pushes, name)

    def leave(self, rank: int, pushes: int, name: str) -> Refusal | None:
        return self.get().leave(rank, pushes, name)

    def share(self, rank: int, finished: Share | None) -> Share | None:
        return self.get().share(rank, finished)


ENDPOINT = Endpoint()


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
