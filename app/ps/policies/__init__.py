"""When the PS applies a push and when its answer goes: one policy per strategy.

- `AsyncPolicy` (asynchronous.py): applied at once into the rank's reply buffer, answered at
  once.
- `BoundedPolicy` (bounded.py, ssp): applied at once; answered once the pusher is at most
  `staleness` pushes ahead of the slowest rank still training.
- `RoundPolicy` (rounds.py, sync): folded into the open round as it lands; once every rank still
  training pushed, their average is applied as one update and every pusher gets the same answer.

Each is given the state, the members, the reply buffers and the push counts, and returns whom to
answer with what (base.py); `policy_for` picks the class from the strategy's descriptor
(app.contract.Strategy).
"""

from __future__ import annotations

from dataclasses import dataclass

from app.contract import PS_STRATEGIES, Strategy, strategy_of
from app.ps.counts import PushCounts
from app.ps.members.members import Members
from app.ps.policies.asynchronous import AsyncPolicy
from app.ps.policies.base import Policy
from app.ps.policies.bounded import BoundedPolicy
from app.ps.policies.rounds import RoundPolicy
from app.ps.replies import ReplyBuffers
from app.ps.state import State

__all__ = ["AsyncPolicy", "BoundedPolicy", "Policy", "PolicyConfig", "RoundPolicy", "policy_for"]


@dataclass(frozen=True)
class PolicyConfig:
    """The strategy (a PS one) and ssp's bound."""

    strategy: str = "async"
    staleness: int = 0

    def __post_init__(self) -> None:
        if not self.kind.has_ps:
            raise ValueError(f"strategy {self.strategy!r}: the PS runs {', '.join(PS_STRATEGIES)}")

    @property
    def kind(self) -> Strategy:
        return strategy_of(self.strategy)


def policy_for(
    config: PolicyConfig,
    state: State,
    members: Members,
    replies: ReplyBuffers,
    counts: PushCounts,
) -> Policy:
    """The policy of `config`'s strategy over these parts."""
    kind = config.kind
    if kind.rounds:
        return RoundPolicy(state, members, replies, counts)
    if kind.bounded:
        return BoundedPolicy(state, members, replies, counts, bound=config.staleness)
    return AsyncPolicy(state, members, replies, counts)
