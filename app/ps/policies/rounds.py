"""sync: one push from every rank still training makes a round; their average is applied as one
update, and every pusher gets the same answer (`RoundPolicy`). A round's pushes are folded into
it as they land (`Round`).

With plain SGD (no momentum, no weight decay) the new state is built in the round's reply
buffer push by push: state - lr/N * the first push, then - lr/N * each next one; otherwise
the pushes' mean is built the same way (push/N, then + each next one / N) and the PS's step
follows it at the close. Either way, when the last push lands one pass over it is left.
N: the ranks the round waits for when its first push lands. With two pushes the mean is the
same bits in either order; the new state built in the reply buffer (plain SGD), and any sum of
more than two, may differ in the last bit with the order the pushes land in.
"""

from __future__ import annotations

from collections.abc import Collection

import torch
from torch.futures import Future

from app.exchange.wire import Push, Reply
from app.ps.counts import PushCounts
from app.ps.members.members import Members
from app.ps.policies.base import Policy, Ready, Stream, Waiting
from app.ps.replies import ReplyBuffers
from app.ps.state import State


class RoundPolicy(Policy):
    """sync: one push from every rank still training, folded as they land (`Round`); their
    average applied as one update, the same answer to all."""

    def __init__(self, state: State, members: Members, replies: ReplyBuffers, counts: PushCounts) -> None:
        super().__init__(state, members, replies, counts)
        self._sum: torch.Tensor | None = None  # where a round's messages are averaged
        self._round: Round | None = None  # the open round's pushes, folded as they land

    def admit(self, rank: int) -> int:
        """A rank the open round was not waiting for (a rank added by scaling up, or one that had
        left or was dropped) is counted from the next round on; a rank the round waits for (one
        of the job's first ranks, joining late) is counted in it. Its old process's push, if it
        waits in the round, is still in the rank's push slot, which the new process is about to
        overwrite: the round keeps a copy."""
        version = self.state.version
        waited_for = rank in self.members.training(version)
        waiting = self.waiting.get(rank)
        if waiting is not None and waiting.message is not None and self.replies.in_segment(waiting.message):
            self.waiting[rank] = waiting._replace(message=waiting.message.clone())
        super().admit(rank)
        open_round = self.waiting and rank not in self.waiting and not waited_for
        return version + 1 if open_round else 0

    def take(
        self, push: Push, message: torch.Tensor, future: Future, staleness: int, stream: Stream | None = None
    ) -> Ready:
        """Keep the push waiting and fold it into the open round; close the round if it was the
        last one awaited (a round's answer is never streamed: `stream` is not used)."""
        state = self.state
        clip = state.clip_factor(push.grad_norm)
        if clip != 1.0:  # each push's gradient clipped by its own norm before the round's mean
            message[: state.num_params].mul_(clip)
        self.hold(push.rank, Waiting(future, message, push.epoch, push.batch, 0, push.to_go))
        self._open_round().fold(push.rank, message, state.vector, state.num_params, state.lr)
        return self._close_round()

    def unblock(self) -> Ready:
        return self._close_round()

    def _open_round(self) -> Round:
        """The open round, opened now if none is."""
        state = self.state
        if self._round is None:
            expected = max(1, len(self.members.training(state.version)))
            if state.plain_sgd():  # the new state built in the reply buffer
                self._round = Round(expected, self.replies.take(0), None)  # one buffer pair for the round
            else:
                if self._sum is None:
                    self._sum = torch.empty_like(state.vector)
                self._round = Round(expected, None, self._sum)
        return self._round

    def _close_round(self) -> Ready:
        """Once every rank still training pushed, apply their average; answer them all.

        The pushes were folded as they landed; if the round closes with other pushes than those
        (a rank finished or was dropped meanwhile, or pushed again from a new process), their
        mean is taken again from the waiting messages, in rank order."""
        state = self.state
        waiting_for = [r for r in self.members.training(state.version) if r not in self.waiting]
        if waiting_for or not self.waiting:
            return []
        waiting = dict(sorted(self.waiting.items()))
        self.waiting = {}
        r, self._round = self._round, None
        vector = r.into if r is not None and r.into is not None else self.replies.take(0)
        if r is not None and r.matches(waiting) and r.into is not None:
            if state.sliced:  # a PS shard's state is a slice of the model's vector: copied, not moved
                state.vector.copy_(vector)
            state.adopt(None if state.sliced else vector)
        else:
            mean = r.mean if r is not None and r.mean is not None and r.matches(waiting) else None
            if mean is None:
                mean = self.average([w.message for w in waiting.values() if w.message is not None])
            state.step(mean, into=None if state.sliced else vector)
            if state.sliced:
                vector.copy_(state.vector)
        for rank, w in waiting.items():
            self.count(rank, w.epoch, w.batch, 0, w.to_go)
        return [(w.future, Reply(vector, state.version, 0, 0)) for w in waiting.values()]

    def average(self, messages: list[torch.Tensor]) -> torch.Tensor:
        """The mean of a round's messages, summed in the order given into one buffer the PS
        keeps (the pushed tensors stay untouched); a round of one is its message itself."""
        if len(messages) == 1:
            return messages[0]
        if self._sum is None:
            self._sum = torch.empty_like(self.state.vector)
        return mean_into(messages, self._sum)


def mean_into(messages: list[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """The mean of two or more messages, summed in the order given into `out` (the
    messages stay untouched); `out`."""
    torch.add(messages[0], messages[1], out=out)
    for message in messages[2:]:
        out.add_(message)
    return out.div_(len(messages))


class Round:
    """`expected`: the ranks the round waited for when its first push landed (each push counts
    1/expected). `into` (the round's reply buffer) holds the new state under plain SGD,
    otherwise `mean` holds the pushes' mean. Valid at the close only if the round closes with
    exactly the pushes folded (`matches`)."""

    def __init__(self, expected: int, into: torch.Tensor | None, mean: torch.Tensor | None) -> None:
        self.expected, self.into, self.mean = expected, into, mean
        self.folded: list[int] = []  # the ranks folded, in order (a rank's new process may fold again)

    def fold(self, rank: int, message: torch.Tensor, state: torch.Tensor, num_params: int, lr: float) -> None:
        """Take rank's pushed `[grads | buffers]`; `state` is the state the round started from.
        A push from a new process of the rank folds again (and the round then closes on the
        waiting pushes)."""
        first, scale = not self.folded, 1.0 / self.expected
        p, b = slice(0, num_params), slice(num_params, None)  # params, buffers
        if self.into is not None:
            if first:
                torch.add(state[p], message[p], alpha=-lr * scale, out=self.into[p])
                torch.mul(message[b], scale, out=self.into[b])
            else:
                self.into[p].add_(message[p], alpha=-lr * scale)
                self.into[b].add_(message[b], alpha=scale)
        else:
            assert self.mean is not None  # a round holds its reply buffer or its mean
            if first:
                torch.mul(message, scale, out=self.mean)
            else:
                self.mean.add_(message, alpha=scale)
        self.folded.append(rank)

    def matches(self, waiting: Collection[int]) -> bool:
        """Whether the round closes with exactly the pushes folded (ranks `waiting`), each once."""
        return len(self.folded) == len(waiting) == self.expected and set(self.folded) == set(waiting)
