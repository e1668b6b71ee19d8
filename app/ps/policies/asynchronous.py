"""async: every push applied and answered at once (asynchronous SGD), into the pusher's reply
buffer, so that its answer is the new state itself and needs no copy (app.ps.replies); with
plain SGD the partitions of a push are built into that buffer as its worker's backward
finishes them (app.ps.early)."""

from __future__ import annotations

import torch

from app.exchange.notes import Note
from app.ps.counts import PushCounts
from app.ps.early import EarlyPartitions
from app.ps.members.members import Members
from app.ps.policies.base import Partitions, Policy
from app.ps.replies import ReplyBuffers
from app.ps.state import State


class AsyncPolicy(Policy):
    """async: every push applied and answered at once; with plain SGD, the partitions of a push
    are built early into the rank's next reply buffer as its backward finishes them.

    `build_early` False (the workers run --overlap): a noted partition is only taken as checked
    (its worker found it finite), and the whole push is built when it arrives. A worker that
    overlaps waits for a reply only after its next batch has computed, so a partition built
    early saves it no wait; and where another rank's push lands first, which with two workers
    or more is most of the time, that partition is built again from the state it moved to:
    twice the PS's work for it. Such a worker's backward runs while its previous push is still
    on the wire: a note of the push after the next one is kept too, so that no partition it
    checked is read again."""

    def __init__(
        self,
        state: State,
        members: Members,
        replies: ReplyBuffers,
        counts: PushCounts,
        partitions: Partitions | None = None,
        build_early: bool = True,
    ) -> None:
        super().__init__(state, members, replies, counts, partitions)
        self.build_early = build_early
        self._early: dict[int, dict[int, EarlyPartitions]] = {}  # rank -> backward -> its push's early partitions

    def admits(self, note: Note, taken: int | None) -> bool:
        """Building early: the next push's notes only. Not building (--overlap): the next two
        pushes', as a worker that overlaps computes one backward past its push on the wire."""
        if self.build_early or taken is None:
            return super().admits(note, taken)
        return taken < note.backward <= taken + 2

    def into(self, rank: int) -> torch.Tensor | None:
        """The rank's reply buffer, where SGD writes the new state; None (in place, the reply a
        copy) for a PS shard and for an optimizer that steps in place (app.ps.optim)."""
        return None if self.state.sliced or not self.state.writes_into else self.replies.take(rank)

    def apply(
        self, message: torch.Tensor, scale: float, into: torch.Tensor | None, early: EarlyPartitions | None
    ) -> None:
        """The step; where partitions were built early into `into` from this very state, the rest."""
        if early is not None and into is early.into and early.built:
            self._apply_rest(message, scale, early)
        else:
            super().apply(message, scale, into, early)

    def take_partition(self, note: Note, message: torch.Tensor) -> None:
        """Partition `note.partition` of the state after rank's push, built from the state as it
        is into the rank's next reply buffer (plain SGD only: momentum needs the whole step)."""
        state = self.state
        if not state.plain_sgd():
            return
        pending = self._early.setdefault(note.rank, {})
        early = pending.get(note.backward)
        if early is None or early.slot != note.slot:
            early = pending[note.backward] = EarlyPartitions(note.backward, note.slot, self.replies.next(note.rank))
        assert self.partitions is not None  # notes come only where the PS cuts partitions
        start, end = self._values(note.partition)
        early.noted.add(note.partition)  # finite: its worker checked it before noting it
        if not self.build_early:
            return
        state.step_values(message[start:end], state.scale_for(state.version - note.version), early.into, start, end)
        early.built[note.partition] = state.version
        self.counts.early_done += 1

    def take_early(self, rank: int, backward: int) -> EarlyPartitions | None:
        """What was noted early of rank's push from `backward`; what was of older pushes goes."""
        pending = self._early.get(rank, {})
        for older in [b for b in pending if b < backward]:
            del pending[older]
        return pending.pop(backward, None)

    def forget(self, rank: int) -> None:
        self._early.pop(rank, None)

    def _values(self, partition: int) -> tuple[int, int]:
        """The parameter values start..end of `partition` (its buffers go with the push)."""
        start, end = (self.partitions or [])[partition]
        return start, min(end, self.state.num_params)

    def _apply_rest(self, message: torch.Tensor, scale: float, early: EarlyPartitions) -> None:
        """`step` into `early.into`, but for the partitions built early from this very state."""
        state, n = self.state, self.state.num_params
        for j in range(len(self.partitions or [])):
            if early.built.get(j) != state.version:
                start, end = self._values(j)
                state.step_values(message[start:end], scale, early.into, start, end)
            else:
                self.counts.early_kept += 1
        early.into[n:].copy_(message[n:])
        state.adopt(early.into)
