"""A sync round's pushes, folded into it as they land (app.ps.server holds one while a round
is open, under its lock).

With plain SGD (no momentum, no weight decay) the new state is built in the round's reply
buffer push by push: state - lr/N * the first push, then - lr/N * each next one; otherwise
the pushes' mean is built the same way (push/N, then + each next one / N) and the PS's step
follows it at the close. Either way, when the last push lands one pass over it is left.
N: the ranks the round waits for when its first push lands. With two pushes the sum is the
same bits in either order; with more, the order they land in sets the last bit.
"""

from __future__ import annotations

from collections.abc import Collection

import torch


class SyncRound:
    """`expected`: the ranks the round waited for when its first push landed (each push counts
    1/expected); `folded`: the ranks folded in, `count`: how many pushes (a rank's new process
    may push again). `into` (the round's reply buffer) holds the new state under plain SGD,
    otherwise `mean` holds the pushes' mean. Valid at the close only if the round closes with
    exactly the pushes folded (`matches`)."""

    def __init__(self, expected: int, into: torch.Tensor | None, mean: torch.Tensor | None) -> None:
        self.expected, self.into, self.mean = expected, into, mean
        self.folded: set[int] = set()
        self.count = 0

    def fold(self, rank: int, message: torch.Tensor, state: torch.Tensor, num_params: int, lr: float) -> None:
        """Take rank's pushed `[grads | buffers]` in; `state` is the state the round started from."""
        first, scale, n = self.count == 0, 1.0 / self.expected, num_params
        if self.into is not None:
            if first:
                torch.add(state[:n], message[:n], alpha=-lr * scale, out=self.into[:n])
                torch.mul(message[n:], scale, out=self.into[n:])
            else:
                self.into[:n].add_(message[:n], alpha=-lr * scale)
                self.into[n:].add_(message[n:], alpha=scale)
        elif first:
            torch.mul(message, scale, out=self.mean)
        else:
            self.mean.add_(message, alpha=scale)
        self.folded.add(rank)
        self.count += 1

    def matches(self, held: Collection[int]) -> bool:
        """Whether the round closes with exactly the pushes folded (ranks `held`)."""
        return self.count == len(held) == self.expected and self.folded == set(held)
