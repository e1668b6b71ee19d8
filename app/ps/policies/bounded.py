"""ssp (stale synchronous parallel, Ho et al. 2013): every push applied at once; its answer waits
until the pusher leads the slowest rank still training by at most `bound` pushes."""

from __future__ import annotations

from app.ps.counts import PushCounts
from app.ps.members.members import Members
from app.ps.policies.base import Policy
from app.ps.replies import ReplyBuffers
from app.ps.state import State


class BoundedPolicy(Policy):
    """ssp: applied at once, answered once the pusher leads the slowest rank still training by
    at most `bound` pushes (or it trains no more)."""

    def __init__(
        self, state: State, members: Members, replies: ReplyBuffers, counts: PushCounts, bound: int = 0
    ) -> None:
        super().__init__(state, members, replies, counts)
        self.bound = bound

    def may_answer(self, rank: int, lead: int) -> bool:
        return lead <= self.bound or rank not in self.members.training(self.state.version)
