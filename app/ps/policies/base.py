"""What every strategy's policy shares: the pushes waiting for their answer, a push applied at
once (async's and ssp's) and the answers that may go.

A policy is given the parts it works on: the state (app.ps.state), the members
(app.ps.members.members), the reply buffers (app.ps.replies) and the push counts
(app.ps.counts). It steps the state and returns whom to answer with what (`Ready`); it never
calls the server back. Every method is called under the server's lock, and the futures it
returns are completed after the lock is released.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch.futures import Future

from app.exchange.progress import Progress
from app.exchange.wire import Push, Refusal, Refused, Reply
from app.ps.counts import PushCounts
from app.ps.members.members import Members
from app.ps.replies import ReplyBuffers
from app.ps.state import State

Ready = list[tuple[Future, Reply]]  # the answers that may go: each future and its reply
Stream = Callable[[torch.Tensor], Progress | None]  # a reply buffer's word (app.exchange.progress), if it has one


class Waiting(NamedTuple):
    """A push whose answer waits (ssp: for the slowest rank; sync: for the round)."""

    future: Future
    message: torch.Tensor | None  # sync: the pushed [grads | buffers]
    epoch: int
    batch: int
    staleness: int
    to_go: int = -1  # the pushes the rank has still to make after this one (app.exchange.wire.Push)


class Policy:
    """When a push is applied and its answer goes. This class: at once, both (async's step;
    ssp refines when the answer goes, sync replaces the step by rounds)."""

    streams = False  # answers a push whose worker waits for each partition before the rest is written

    def __init__(self, state: State, members: Members, replies: ReplyBuffers, counts: PushCounts) -> None:
        self.state, self.members, self.replies, self.counts = state, members, replies, counts
        self.waiting: dict[int, Waiting] = {}  # rank -> its push whose answer waits

    # Who trains changes.

    def admit(self, rank: int) -> int:
        """A new process of `rank` joins (called before it is the rank's member): the first
        version whose round counts it (0: at once)."""
        return 0

    def let_go(self, rank: int) -> Ready:
        """Nobody waits for `rank` any more (it left, or was dropped): its push waiting for an
        answer gets the state as it is (ssp: it was applied; sync: it was not, and the round goes
        on without it)."""
        waiting = self.waiting.pop(rank, None)
        ready = self.unblock()
        if waiting is not None:
            vector = self.replies.take(rank).copy_(self.state.vector)
            ready.append((waiting.future, Reply(vector, self.state.version, waiting.staleness, 0)))
        return ready

    def unblock(self) -> Ready:
        """The answers that may go now that the set of ranks training changed."""
        return self.release()

    # A push.

    def take(
        self, push: Push, message: torch.Tensor, future: Future, staleness: int, stream: Stream | None = None
    ) -> Ready:
        """Apply the push now, keep its answer waiting, and release the answers that may go.
        `stream`: the word of a reply buffer (None: it has none) where the pusher waits for each
        partition; a policy that `streams` answers as soon as the first is written (the state's
        `finish` writes the rest)."""
        into = self.into(push.rank)
        scale = self.state.scale_for(staleness, push.grad_norm)
        progress, streamed = None, -1
        if stream is not None and into is not None and self.streams and self.state.streams(into):
            progress = stream(into)
        if progress is not None and into is not None:
            streamed = self.state.step_streamed(message, scale, into, progress)
            self.counts.streamed += 1
        else:
            self.state.step(message, scale, into)
        self.count(push.rank, push.epoch, push.batch, staleness, push.to_go)
        self.hold(push.rank, Waiting(future, None, push.epoch, push.batch, staleness, push.to_go))
        ready = self.release(fresh=push.rank if into is not None else None)
        if streamed < 0:
            return ready
        return [(f, r._replace(streamed=streamed) if r.vector is into else r) for f, r in ready]

    def into(self, rank: int) -> torch.Tensor | None:
        """Where a push's new state is written: rank's reply buffer, where the answer goes at once
        (not a PS shard's, whose state is a view of the model); None: in place."""
        return None

    def count(self, rank: int, epoch: int, batch: int, staleness: int, to_go: int = -1) -> None:
        """One push of rank's applied: where the rank is now (and the pushes it has still to
        make), and the push counts."""
        self.members.record_push(rank, epoch, batch, to_go)
        self.counts.count(staleness)

    def hold(self, rank: int, waiting: Waiting) -> None:
        """Keep rank's push waiting for its answer. One of the rank's earlier process still
        waiting (it died waiting) is refused: this one replaces it."""
        old = self.waiting.pop(rank, None)
        if old is not None:
            old.future.set_result(Refusal(Refused.STALE, f"worker{rank} pushed again from a new process; exiting"))
        self.waiting[rank] = waiting

    def release(self, fresh: int | None = None) -> Ready:
        """The waiting answers that may go now. `fresh`: the rank whose reply buffer the state was
        just written into (it is answered with it)."""
        state, ready = self.state, []
        for rank, waiting in list(self.waiting.items()):
            lead = self.members.lead(rank, state.version)
            if self.may_answer(rank, lead):
                del self.waiting[rank]
                vector = state.vector if rank == fresh else self.replies.take(rank).copy_(state.vector)
                ready.append((waiting.future, Reply(vector, state.version, waiting.staleness, lead)))
        return ready

    def may_answer(self, rank: int, lead: int) -> bool:
        return True
