"""A sync round's pushes, folded into it as they land (app.ps.server holds one while a round
is open, under its lock).

With plain SGD (no momentum, no weight decay) the new state is built in the round's reply
buffer push by push: state - lr/N * the first push, then - lr/N * each next one; otherwise
the pushes' mean is built the same way (push/N, then + each next one / N) and the PS's step
follows it at the close. Either way, when the last push lands one pass over it is left.
N: the ranks the round waits for when its first push lands. With two pushes the mean is the
same bits in either order; the new state built in the reply buffer (plain SGD), and any sum of
more than two, may differ in the last bit with the order the pushes (or, taken ahead, their
partitions) land in.

A push is folded partition by partition (app.exchange.layout; one partition, the whole
vector, when the PS does not take partitions ahead): a worker whose backward has finished a
partition may have it folded before its push arrives (app.ps.early), and the push folds
the rest. Every element is folded once per push, in the order the pushes reach it.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch


class SyncRound:
    """`expected`: the ranks the round waited for when its first push landed (each push counts
    1/expected); `parts`: the partitions a push is folded by. `into` (the round's reply
    buffer) holds the new state under plain SGD, otherwise `mean` holds the pushes' mean. Valid
    at the close only if the round closes with exactly the pushes folded (`matches`)."""

    def __init__(
        self, expected: int, into: torch.Tensor | None, mean: torch.Tensor | None, parts: Sequence[tuple[int, int]]
    ) -> None:
        self.expected, self.into, self.mean, self.parts = expected, into, mean, list(parts)
        self.folded: list[set[int]] = [set() for _ in self.parts]  # the ranks folded into each partition
        self.counts = [0] * len(self.parts)  # folds into each partition (a rank's new process may fold again)
        self.backward: list[dict[int, int]] = [{} for _ in self.parts]  # rank -> the backward folded ahead
        self.kept = 0  # partitions folded ahead that their push found folded

    def fold(
        self,
        rank: int,
        message: torch.Tensor,
        state: torch.Tensor,
        num_params: int,
        lr: float,
        backward: int | None = None,
    ) -> None:
        """Take rank's pushed `[grads | buffers]`, coming from its backward `backward`: every
        partition not folded ahead from that very backward. `state` is the state the round
        started from. A push from a new process of the rank folds again (and the round then
        closes on the held pushes)."""
        for j in range(len(self.parts)):
            if backward is None or self.backward[j].get(rank) != backward:
                self.fold_part(rank, j, message, state, num_params, lr)
            else:
                self.kept += 1

    def fold_part(
        self,
        rank: int,
        j: int,
        message: torch.Tensor,
        state: torch.Tensor,
        num_params: int,
        lr: float,
        backward: int | None = None,
    ) -> None:
        """Fold partition `j` of rank's push (values start..end of `message`); `backward`: it is
        folded ahead of the push, from that backward of the rank's."""
        start, end = self.parts[j]
        first, scale = self.counts[j] == 0, 1.0 / self.expected
        p, b = slice(start, max(start, min(end, num_params))), slice(max(start, num_params), end)  # params, buffers
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
                torch.mul(message[start:end], scale, out=self.mean[start:end])
            else:
                self.mean[start:end].add_(message[start:end], alpha=scale)
        self.folded[j].add(rank)
        self.counts[j] += 1
        if backward is not None:
            self.backward[j][rank] = backward

    def forget(self, rank: int) -> None:
        """A new process of `rank` joined: what its old one folded ahead is no part of the new
        one's push (which then folds every partition again)."""
        for ahead in self.backward:
            ahead.pop(rank, None)

    def matches(self, held: Collection[int]) -> bool:
        """Whether the round closes with exactly the pushes folded (ranks `held`), every
        partition of each once."""
        ranks = set(held)
        return all(
            count == len(held) == self.expected and folded == ranks for count, folded in zip(self.counts, self.folded)
        )
