"""async: every push applied and answered at once (asynchronous SGD), into the pusher's reply
buffer, so that its answer is the new state itself and needs no copy (app.ps.replies)."""

from __future__ import annotations

import torch

from app.ps.policies.base import Policy


class AsyncPolicy(Policy):
    """async: every push applied and answered at once; where its worker waits for each partition
    of the new state (app.exchange.streamed_pull), answered once the first is written."""

    streams = True

    def into(self, rank: int) -> torch.Tensor | None:
        """The rank's reply buffer, where SGD writes the new state; None (in place, the reply a
        copy) for a PS shard and for an optimizer that steps in place (app.ps.optim)."""
        return None if self.state.sliced or not self.state.writes_into else self.replies.take(rank)
