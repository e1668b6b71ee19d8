"""What a PS process serves over RPC, and the calls between the PS's own processes.

RPC runs plain functions by name, so what a process serves has to be reachable from them:
an `Endpoint` is built for each serving, over the PS it serves and the hooks of its role, and
`Endpoint.serving()` installs it, for the duration of the block, in the one table the calls
read (app.exchange.calls' `serving`): the workers' calls there and the PS's own below find it
through that table, and nothing else of it is process-wide.

- Every PS process (the main PS and each shard) serves the calls workers make
  (app.exchange.calls: join, pull, push (a tensor, or a push slot), finish, leave,
  share): `Endpoint` is that service, over the PS it is given (`Served`: what it calls of
  app.ps.server's ParameterServer, which this module does not import). `rpc_drop`: the main
  PS forwards a worker's drop to the shards.
- The main PS of a sharded PS: `rpc_register`, `rpc_resumed` (shards call them; its `Main`).
- A shard: `rpc_checkpoint`, `rpc_end` (the main PS calls them; its `Shard`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional, Protocol

import torch
from torch.futures import Future

from app.exchange import calls, transport
from app.exchange.progress import Progress
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

    def join(self, rank: int, name: str) -> Joined: ...
    def pull(self, rank: int) -> tuple[torch.Tensor, int]: ...
    def submit(
        self,
        push: Push,
        message: torch.Tensor,
        stream: Callable[[torch.Tensor], Progress | None] | None = None,
        after: Callable[[Callable[[], None]], None] | None = None,
    ) -> Future: ...
    def finish(self, rank: int, pushes: int, name: str = "") -> Refusal | None: ...
    def leave(self, rank: int, pushes: int, name: str = "") -> Refusal | None: ...
    def share(self, rank: int, finished: Share | None = None) -> Share | None: ...
    def drop(self, rank: int, name: str) -> bool: ...


@dataclass(frozen=True)
class Main:
    """The main PS's side of the calls its shards make. Shards register through `register`
    (None: --shards 1) and resume from the checkpoint labelled `resumed()`: the main PS's
    newest, the one it resumed from or wrote since (None: none yet, a new run), so a shard
    restarted mid-run gets its slice back from the last checkpoint rather than the initial
    values."""

    register: Register | None = None  # ShardSet.register
    resumed: Callable[[], Resumed] = lambda: None


class Shard:
    """A shard's side of the calls the main PS makes: it checkpoints through the writer
    `checkpointing` gives it (once it resumed), and training ends (`ended`; `finished`:
    whether every worker finished)."""

    def __init__(self) -> None:
        self.save_labelled: SaveLabelled | None = None
        self.ended = threading.Event()
        self.finished = False

    @contextmanager
    def checkpointing(self, save_labelled: SaveLabelled) -> Iterator[None]:
        """The main PS asks this shard to checkpoint through `save_labelled` while the block runs."""
        self.save_labelled = save_labelled
        try:
            yield
        finally:
            self.save_labelled = None


class Endpoint:
    """What one serving of a PS process answers: the workers' calls, over `server` (its joins
    through `join` where given: app.ps.members.liveness.LivenessMonitor.join on the main PS),
    and the calls between the PS's processes, through its role's hooks (`main`, `shard`)."""

    def __init__(
        self, server: Served, join: Admit | None = None, main: Main | None = None, shard: Shard | None = None
    ) -> None:
        self.server, self.admit, self.main, self.shard = server, join, main, shard

    @contextmanager
    def serving(self) -> Iterator[None]:
        """Serve: the RPC entry points answer through this endpoint."""
        with calls.serving(self):
            yield

    # The calls workers make (app.exchange.calls.Service).

    def join(self, rank: int, name: str) -> Joined | Taken | NotReady:
        """A worker process starts: the state to start from and its rank's progress (Joined; Taken
        when another process holds the rank), and where this PS process has one, its
        shared-memory segment (`exchange`: an Offer the worker maps when it is on this host)."""
        answer = self.admit(rank, name) if self.admit is not None else self.server.join(rank, name)
        if isinstance(answer, Joined):
            return answer._replace(exchange=self.server.shared.offer())
        return answer

    def pull(self, rank: int) -> tuple[torch.Tensor, int]:
        return self.server.pull(rank)

    def push(self, message: torch.Tensor | InSlot, push: Push) -> Future:
        """The push's message resolved: a tensor as it came, or the push slot that holds it (the
        answer then names the region of the new state)."""
        server = self.server
        if not isinstance(message, InSlot):
            return server.submit(push, message)
        shared = server.shared  # NO_SEGMENT refuses the slot
        values = shared.push(push.rank, message.slot, message.dtype, message.numel)
        # a worker that waits for each partition is answered once the first is written, the rest after
        answer = server.submit(push, values, shared.progress, transport.after_reply)
        return answer.then(lambda done: shared.answer(done.value()))

    def finish(self, rank: int, pushes: int, name: str) -> Refusal | None:
        return self.server.finish(rank, pushes, name)

    def leave(self, rank: int, pushes: int, name: str) -> Refusal | None:
        return self.server.leave(rank, pushes, name)

    def share(self, rank: int, finished: Share | None) -> Share | None:
        return self.server.share(rank, finished)

    # The calls between the PS's processes (below).

    def drop(self, rank: int, name: str) -> bool:
        return self.server.drop(rank, name)

    def resumed(self) -> Resumed:
        return self.main.resumed() if self.main is not None else None

    def register(self, index: int, name: str, k: int, part: tuple[int, int]) -> str | None:
        if self.main is None or self.main.register is None:
            return "the main parameter server runs with --shards 1"
        return self.main.register(index, name, k, part)

    def checkpoint(self, version: int) -> str | None:
        if self.shard is None or self.shard.save_labelled is None:
            return "this shard is not serving yet"
        return self.shard.save_labelled(version)

    def end(self, finished: bool) -> None:
        if self.shard is None:
            raise RuntimeError("this parameter server process is not a shard")
        self.shard.finished = finished
        self.shard.ended.set()


def endpoint() -> Endpoint:
    """The endpoint this process serves (app.exchange.calls' table); RuntimeError when none."""
    served = calls.service()
    if not isinstance(served, Endpoint):
        raise RuntimeError("no parameter server's endpoint is serving in this process")
    return served


@transport.served
def rpc_drop(rank: int, name: str) -> bool:
    return endpoint().drop(rank, name)


@transport.served
def rpc_resumed() -> tuple[int, str] | None:
    """The main PS's newest checkpoint, (version, run id), which a (re)starting shard resumes
    from (None: none yet)."""
    return endpoint().resumed()


@transport.served
def rpc_register(index: int, name: str, k: int, part: tuple[int, int]) -> str | None:
    """A shard announces itself to the main PS; an error line, or None."""
    return endpoint().register(index, name, k, part)


@transport.served
def rpc_checkpoint(version: int) -> str | None:
    """Write this shard's checkpoint labelled `version`; an error line, or None."""
    return endpoint().checkpoint(version)


@transport.served
def rpc_end(finished: bool) -> None:
    """Training ended (`finished`: every worker finished): the shard saves and exits."""
    endpoint().end(finished)
