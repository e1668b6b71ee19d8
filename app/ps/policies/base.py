"""What every strategy's policy shares: the pushes waiting for their answer, a push applied at
once (async's and ssp's), the answers that may go, and the bookkeeping of notes (which push of
a rank's process comes next).

A policy is given the parts it works on: the state (app.ps.state), the members
(app.ps.members.members), the reply buffers (app.ps.replies), the push counts (app.ps.counts)
and the partitions a push may be taken early by (app.ps.early). It steps the state and returns
whom to answer with what (`Ready`); it never calls the server back. Every method is called
under the server's lock (`checked` excepted: it reads what `early_of` returned), and the futures
it returns are completed after the lock is released.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch.futures import Future

from app.exchange.notes import Note
from app.exchange.wire import Push, Refusal, Refused, Reply
from app.ps.counts import PushCounts
from app.ps.early import EarlyPartitions
from app.ps.members.members import Members
from app.ps.replies import ReplyBuffers
from app.ps.state import State

Ready = list[tuple[Future, Reply]]  # the answers that may go: each future and its reply
Partitions = Sequence[tuple[int, int]]


class Waiting(NamedTuple):
    """A push whose answer waits (ssp: for the slowest rank; sync: for the round)."""

    future: Future
    message: torch.Tensor | None  # sync: the pushed [grads | buffers]
    epoch: int
    batch: int
    staleness: int
    to_go: int = -1  # the pushes the rank has still to make after this one (app.exchange.wire.Push)


def noted_backward(push: Push) -> int | None:
    """The backward a push comes from when its partitions were noted early; None otherwise."""
    return push.backward if push.noted else None


class Policy:
    """When a push is applied and its answer goes. This class: at once, both (async's step;
    ssp refines when the answer goes, sync replaces the step by rounds)."""

    def __init__(
        self,
        state: State,
        members: Members,
        replies: ReplyBuffers,
        counts: PushCounts,
        partitions: Partitions | None = None,
    ) -> None:
        self.state, self.members, self.replies, self.counts = state, members, replies, counts
        self.partitions = partitions  # None: every push is taken whole, when it arrives
        self.waiting: dict[int, Waiting] = {}  # rank -> its push whose answer waits
        self.taken: dict[int, int] = {}  # rank -> the backward of its process's push last taken (-1: none yet)

    # Who trains changes.

    def admit(self, rank: int) -> int:
        """A new process of `rank` joins (called before it is the rank's member): nothing taken
        early of its old process's push counts, and its backwards count from 0. The first version
        whose round counts it (0: at once)."""
        self.forget(rank)
        self.taken[rank] = -1
        return 0

    def let_go(self, rank: int) -> Ready:
        """Nobody waits for `rank` any more (it left, or was dropped): what it had taken early is
        forgotten, and its push waiting for an answer gets the state as it is (ssp: it was
        applied; sync: it was not, and the round goes on without it)."""
        waiting = self.waiting.pop(rank, None)
        self.forget(rank)
        ready = self.unblock()
        if waiting is not None:
            vector = self.replies.take(rank).copy_(self.state.vector)
            ready.append((waiting.future, Reply(vector, self.state.version, waiting.staleness, 0)))
        return ready

    def unblock(self) -> Ready:
        """The answers that may go now that the set of ranks training changed."""
        return self.release()

    # A push.

    def early_of(self, push: Push) -> EarlyPartitions | None:
        """What was taken early of `push` (None: nothing, or its partitions were not noted); notes
        of its backward are passed over from now on."""
        if push.backward is None:
            return None
        self.taken[push.rank] = push.backward
        early = self.take_early(push.rank, push.backward)
        return early if push.noted else None

    def checked(self, push: Push, early: EarlyPartitions | None) -> set[int]:
        """The partitions of `push` noted early (`early`: what was taken early of it), each checked
        finite by the worker before it noted it."""
        return early.noted if early is not None else set()

    def take(
        self, push: Push, message: torch.Tensor, future: Future, staleness: int, early: EarlyPartitions | None
    ) -> Ready:
        """Apply the push now (the rest of it, where its partitions were applied early into the
        buffer its answer goes in), keep its answer waiting, and release the answers that may go."""
        into = self.into(push.rank)
        self.apply(message, self.state.scale_for(staleness, push.grad_norm), into, early)
        self.count(push.rank, push.epoch, push.batch, staleness, push.to_go)
        self.hold(push.rank, Waiting(future, None, push.epoch, push.batch, staleness, push.to_go))
        return self.release(fresh=push.rank if into is not None else None)

    def apply(
        self, message: torch.Tensor, scale: float, into: torch.Tensor | None, early: EarlyPartitions | None
    ) -> None:
        """One SGD step of the state with `message`, the new state into `into` (None: in place)."""
        self.state.step(message, scale, into)

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

    # Notes: a partition of a push, in its slot before the push (app.ps.early).

    def note(self, note: Note, message: torch.Tensor) -> None:
        """A partition of rank's next push landed in its slot (`message`: the slot): taken early
        when it is of the push that comes next from its process."""
        if self.admits(note, self.taken.get(note.rank)):
            self.take_partition(note, message)

    def admits(self, note: Note, taken: int | None) -> bool:
        """Whether a note is of the push that comes next from its process, whose last push taken
        was from backward `taken` (-1: none yet; None: the rank is not joined): one of an
        older push is late, one of a later push would build or fold it before its turn."""
        return taken is not None and note.backward == taken + 1

    def take_partition(self, note: Note, message: torch.Tensor) -> None:
        """Take the noted partition early (async builds it, sync folds it); this class: not at all."""

    def take_early(self, rank: int, backward: int) -> EarlyPartitions | None:
        """What was taken early of rank's push from `backward`."""
        return None

    def forget(self, rank: int) -> None:
        """A new process of `rank`, or the rank left: nothing taken early of its old push counts."""
