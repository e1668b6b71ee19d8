"""When the PS applies a push and when its reply goes out: one policy class per strategy.

`ParameterServer` (app.ps.server) owns the state, the roster, the held replies and the lock;
its policy decides, under that lock, what a push does:

- `AsyncPolicy`: applied at once into the rank's reply buffer, answered at once; partitions
  noted ahead of the push are built into that buffer as they land (plain SGD, workers that do
  not --overlap).
- `BoundedPolicy` (ssp): applied at once; answered once the pusher is at most `staleness`
  pushes ahead of the slowest rank still training.
- `RoundPolicy` (sync): folded into the open round as it lands; once every rank still training
  pushed, their average is applied as one update and every pusher gets the same answer.

`policy_for` picks the class from the strategy's descriptor (app.contract.Strategy). Every
method with a `ready` result is called under the server's lock and returns the futures to
complete after it is released.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch
from torch.futures import Future

from app.contract import Strategy
from app.exchange.notes import Note
from app.exchange.wire import Reply
from app.ps.early import Ahead
from app.ps.replies import ReplyBuffers
from app.ps.sync_round import SyncRound
from app.ps.tally import Tally
from app.ps.update import mean_into

Ready = list[tuple[Future, Reply]]


class Held(NamedTuple):
    """A push whose reply waits (ssp: for the slowest rank; sync: for the round)."""

    future: Future
    message: torch.Tensor | None  # sync: the pushed [grads | buffers]
    epoch: int
    batch: int
    staleness: int


class Host(Protocol):
    """What a policy reads and calls of its server (app.ps.server.ParameterServer), under its lock."""

    state: torch.Tensor  # the values this PS serves
    version: int
    lr: float
    bound: int  # ssp's staleness bound
    sliced: bool  # a PS shard: `state` is a view of the model's vector
    parts: list[tuple[int, int]] | None  # partitions noted ahead of a push (app.ps.early)
    num_params: int
    size: int
    held: dict[int, Held]  # rank -> its push whose reply waits
    tally: Tally  # its counts: a policy adds the partitions it built ahead
    replies: ReplyBuffers  # each rank's two, used in turn

    def scale_for(self, staleness: int) -> float: ...
    def step(self, message: torch.Tensor, scale: float = 1.0, into: torch.Tensor | None = None) -> None: ...
    def count_push(self, rank: int, epoch: int, batch: int, staleness: int) -> None: ...
    def hold(self, rank: int, held: Held) -> None: ...
    def lead(self, rank: int) -> int: ...
    def training_ranks(self) -> list[int]: ...
    def adopt(self, into: torch.Tensor | None) -> None: ...
    def momentum_or_decay(self) -> bool: ...


class Policy:
    """The part every strategy shares: what a push applied at once does (async's and ssp's)."""

    def __init__(self, ps: Host) -> None:
        self.ps = ps

    def take(
        self,
        rank: int,
        message: torch.Tensor,
        future: Future,
        epoch: int,
        batch: int,
        staleness: int,
        ahead: Ahead | None,
        backward: int | None,
    ) -> Ready:
        """Apply rank's push now (the rest of it, where its partitions were applied ahead into
        the buffer its reply goes in), hold its answer, and release the answers that may go."""
        ps = self.ps
        into = self.into(rank)
        self.apply(message, ps.scale_for(staleness), into, ahead)
        ps.count_push(rank, epoch, batch, staleness)
        ps.hold(rank, Held(future, None, epoch, batch, staleness))
        return self.release(fresh=rank if into is not None else None)

    def apply(self, message: torch.Tensor, scale: float, into: torch.Tensor | None, ahead: Ahead | None) -> None:
        """One SGD step of the state with `message`, the new state into `into` (None: in place)."""
        self.ps.step(message, scale, into)

    def into(self, rank: int) -> torch.Tensor | None:
        """Where a push's new state is written: rank's reply buffer, where the reply goes at once
        (not a PS shard's, whose state is a view of the model); None: in place."""
        return None

    def release(self, fresh: int | None = None) -> Ready:
        """The held replies that may go now. `fresh`: the rank whose reply buffer the state was
        just written into (it is answered with it)."""
        ps, ready = self.ps, []
        for rank, held in list(ps.held.items()):
            lead = ps.lead(rank)
            if self.may_answer(rank, lead):
                del ps.held[rank]
                vector = ps.state if rank == fresh else ps.replies.take(rank).copy_(ps.state)
                ready.append((held.future, Reply(vector, ps.version, held.staleness, lead)))
        return ready

    def may_answer(self, rank: int, lead: int) -> bool:
        return True

    def unblock(self) -> Ready:
        """The answers that may go now that the set of ranks training changed."""
        return self.release()

    def admits(self, note: Note, taken: int | None) -> bool:
        """Whether a note is of the push that comes next from its process, whose last push taken
        was from backward `taken` (-1: none yet; None: the rank is not joined): one of an
        older push is late, one of a later push would build or fold it before its turn."""
        return taken is not None and note.backward == taken + 1

    def note(self, note: Note, message: torch.Tensor) -> None:
        """A partition of rank's next push landed in its slot (app.ps.early)."""

    def take_ahead(self, rank: int, backward: int) -> Ahead | None:
        """What was built ahead of rank's push from `backward`."""
        return None

    def forget(self, rank: int) -> None:
        """A new process of `rank`, or the rank left: nothing taken ahead of its old push counts."""

    def checked(self, rank: int, backward: int | None, ahead: Ahead | None) -> set[int]:
        """The partitions of rank's push from `backward` that were noted ahead (`ahead`: what
        was built ahead of it), each checked finite by the worker before it noted it."""
        return ahead.noted if ahead is not None else set()


class AsyncPolicy(Policy):
    """async: every push applied and answered at once; with plain SGD, the partitions of a push
    are built into the rank's next reply buffer as its backward finishes them.

    `build_ahead` False (the workers run --overlap): a noted partition is only taken as checked
    (its worker found it finite), and the whole push is built when it arrives. A worker that
    overlaps waits for a reply only after its next batch has computed, so a partition built
    ahead saves it no wait; and where another rank's push lands first, which with two workers
    or more is most of the time, that partition is built again from the state it moved to:
    twice the PS's work for it. Such a worker's backward runs while its previous push is still
    on the wire: a note of the push after the next one is kept too, so that no partition it
    checked is read again."""

    def __init__(self, ps: Host, build_ahead: bool = True) -> None:
        super().__init__(ps)
        self.build_ahead = build_ahead
        self._ahead: dict[int, dict[int, Ahead]] = {}  # rank -> backward -> what was noted (built) ahead of its push

    def admits(self, note: Note, taken: int | None) -> bool:
        """Building ahead: the next push's notes only. Not building (--overlap): the next two
        pushes', as a worker that overlaps computes one backward past its push on the wire."""
        if self.build_ahead or taken is None:
            return super().admits(note, taken)
        return taken < note.backward <= taken + 2

    def into(self, rank: int) -> torch.Tensor | None:
        return None if self.ps.sliced else self.ps.replies.take(rank)

    def apply(self, message: torch.Tensor, scale: float, into: torch.Tensor | None, ahead: Ahead | None) -> None:
        """The step; where partitions were built ahead into `into` from this very state, the rest."""
        if ahead is not None and into is ahead.into and ahead.built:
            self._apply_rest(message, scale, ahead)
        else:
            super().apply(message, scale, into, ahead)

    def note(self, note: Note, message: torch.Tensor) -> None:
        """Partition `note.partition` of the state after rank's push, built from the state as it
        is into the rank's next reply buffer (plain SGD only: momentum needs the whole step)."""
        ps = self.ps
        if ps.momentum_or_decay():
            return
        pending = self._ahead.setdefault(note.rank, {})
        ahead = pending.get(note.backward)
        if ahead is None or ahead.slot != note.slot:
            ahead = pending[note.backward] = Ahead(note.backward, note.slot, ps.replies.next(note.rank))
        assert ps.parts is not None  # notes come only where the PS cuts partitions
        start, end = ps.parts[note.partition]
        end = min(end, ps.num_params)
        ahead.noted.add(note.partition)  # finite: its worker checked it before noting it
        if not self.build_ahead:
            return
        self._step_into(message[start:end], ps.scale_for(ps.version - note.version), ahead.into, start, end)
        ahead.built[note.partition] = ps.version
        ps.tally.ahead_done += 1

    def take_ahead(self, rank: int, backward: int) -> Ahead | None:
        """What was noted ahead of rank's push from `backward`; what was of older pushes goes."""
        pending = self._ahead.get(rank, {})
        for older in [b for b in pending if b < backward]:
            del pending[older]
        return pending.pop(backward, None)

    def forget(self, rank: int) -> None:
        self._ahead.pop(rank, None)

    def _step_into(self, grads: torch.Tensor, scale: float, into: torch.Tensor, start: int, end: int) -> None:
        """Plain SGD on values start..end: the new values into `into` (grads are those values')."""
        if scale != 1.0:
            grads = grads * scale
        torch.add(self.ps.state[start:end], grads, alpha=-self.ps.lr, out=into[start:end])

    def _apply_rest(self, message: torch.Tensor, scale: float, ahead: Ahead) -> None:
        """`step` into `ahead.into`, but for the partitions built ahead from this very state."""
        ps = self.ps
        n = ps.num_params
        for j, (start, end) in enumerate(ps.parts or []):
            if ahead.built.get(j) != ps.version:
                self._step_into(message[start : min(end, n)], scale, ahead.into, start, min(end, n))
            else:
                ps.tally.ahead_kept += 1
        ahead.into[n:].copy_(message[n:])
        ps.adopt(ahead.into)


class BoundedPolicy(Policy):
    """ssp: applied at once, answered once the pusher leads the slowest rank still training by
    at most `staleness` pushes (Ho et al. 2013)."""

    def may_answer(self, rank: int, lead: int) -> bool:
        return lead <= self.ps.bound or rank not in self.ps.training_ranks()


class RoundPolicy(Policy):
    """sync: one push from every rank still training, folded as they land (app.ps.sync_round);
    their average applied as one update, the same answer to all."""

    def __init__(self, ps: Host) -> None:
        super().__init__(ps)
        self._sum: torch.Tensor | None = None  # where a round's messages are averaged
        self._round: SyncRound | None = None  # the open round's pushes, folded as they land

    def take(
        self,
        rank: int,
        message: torch.Tensor,
        future: Future,
        epoch: int,
        batch: int,
        staleness: int,
        ahead: Ahead | None,
        backward: int | None,
    ) -> Ready:
        """Hold rank's push and fold it into the open round (the partitions folded ahead from
        `backward` are in it already); close the round if it was the last one awaited."""
        ps = self.ps
        ps.hold(rank, Held(future, message, epoch, batch, 0))
        self._open_round().fold(rank, message, ps.state, ps.num_params, ps.lr, backward)
        return self._close_round()

    def unblock(self) -> Ready:
        return self._close_round()

    def note(self, note: Note, message: torch.Tensor) -> None:
        """Fold the partition into the open round, once per rank and partition."""
        ps = self.ps
        round_ = self._open_round()
        if note.rank in round_.folded[note.partition]:
            return
        round_.fold_part(note.rank, note.partition, message, ps.state, ps.num_params, ps.lr, note.backward)
        ps.tally.ahead_done += 1

    def forget(self, rank: int) -> None:
        if self._round is not None:
            self._round.forget(rank)

    def checked(self, rank: int, backward: int | None, ahead: Ahead | None) -> set[int]:
        """The partitions of rank's push from `backward` folded ahead into the open round."""
        r = self._round
        if r is None or backward is None:
            return set()
        return {j for j, by in enumerate(r.backward) if by.get(rank) == backward}

    def _open_round(self) -> SyncRound:
        """The open round, opened now if none is."""
        ps = self.ps
        if self._round is None:
            expected = max(1, len(ps.training_ranks()))
            parts = ps.parts or [(0, ps.size)]
            if not ps.momentum_or_decay():  # plain SGD: the new state built in the reply buffer
                self._round = SyncRound(expected, ps.replies.take(0), None, parts)  # one buffer pair for the round
            else:
                if self._sum is None:
                    self._sum = torch.empty_like(ps.state)
                self._round = SyncRound(expected, None, self._sum, parts)
        return self._round

    def _close_round(self) -> Ready:
        """Once every rank still training pushed, apply their average; answer them all.

        The pushes were folded as they landed; if the round closes with other pushes than those
        (a rank finished or was dropped meanwhile, or pushed again from a new process), their
        mean is taken again from the held messages, in rank order."""
        ps = self.ps
        waiting_for = [r for r in ps.training_ranks() if r not in ps.held]
        if waiting_for or not ps.held:
            return []
        held = dict(sorted(ps.held.items()))
        ps.held = {}
        r, self._round = self._round, None
        vector = r.into if r is not None and r.into is not None else ps.replies.take(0)
        if r is not None and r.matches(held):
            ps.tally.ahead_kept += r.kept
        if r is not None and r.matches(held) and r.into is not None:
            if ps.sliced:  # a PS shard's state is a slice of the model's vector: copied, not moved
                ps.state.copy_(vector)
            ps.adopt(None if ps.sliced else vector)
        else:
            mean = r.mean if r is not None and r.mean is not None and r.matches(held) else None
            if mean is None:
                mean = self.average([h.message for h in held.values() if h.message is not None])
            ps.step(mean, into=None if ps.sliced else vector)
            if ps.sliced:
                vector.copy_(ps.state)
        for rank, h in held.items():
            ps.count_push(rank, h.epoch, h.batch, 0)
        return [(h.future, Reply(vector, ps.version, 0, 0)) for h in held.values()]

    def average(self, messages: list[torch.Tensor]) -> torch.Tensor:
        """The mean of a round's messages, summed in the order given into one buffer the PS
        keeps (the pushed tensors stay untouched); a round of one is its message itself."""
        if len(messages) == 1:
            return messages[0]
        if self._sum is None:
            self._sum = torch.empty_like(self.ps.state)
        return mean_into(messages, self._sum)


def policy_for(strategy: Strategy, ps: Host, overlap: bool = False) -> Policy:
    """The policy of `strategy` (a PS strategy) for the server `ps`; `overlap`: the workers
    run --overlap (async builds nothing ahead of a push then)."""
    if strategy.rounds:
        return RoundPolicy(ps)
    if strategy.bounded:
        return BoundedPolicy(ps)
    return AsyncPolicy(ps, build_ahead=not overlap)
