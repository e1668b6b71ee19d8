"""Where the PS writes each rank's replies: two buffers per rank, used in turn.

RPC sends a returned tensor from its memory after `push` returns, and a rank pushes again
only once it has received the reply; the second buffer keeps even a reply still in flight
then intact. Unsliced async and sync write each new state into one of them (app.ps.state's
`step` with `into`): the state itself lives there, and the reply is that buffer, not a copy.
With a shared-memory segment (app.exchange.ps_end) a rank's reply buffers are its regions there:
one, or two under --overlap; the PS allocates its own for ranks the segment has none for.
Rank 0's are a sync round's.
"""

from __future__ import annotations

import torch

from app.exchange.ps_end import NO_SEGMENT, PSEnd


class ReplyBuffers:
    def __init__(self, size: int, shared: PSEnd = NO_SEGMENT) -> None:
        self.size, self.shared = size, shared
        self._buffers: dict[int, list[torch.Tensor]] = {}

    def take(self, rank: int) -> torch.Tensor:
        """Rank's reply buffer for this push (the other one, where it has two, holds its
        previous reply)."""
        buffers = self._of(rank)
        buffers.reverse()
        return buffers[0]

    def in_segment(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` lies in the shared-memory segment (a push slot, which its worker
        overwrites with its next push)."""
        return self.shared.holds(tensor)

    def _of(self, rank: int) -> list[torch.Tensor]:
        buffers = self._buffers.get(rank)
        if buffers is None:
            shared = self.shared.reply_buffers(rank)
            buffers = self._buffers[rank] = shared or [torch.empty(self.size) for _ in range(2)]
        return buffers
