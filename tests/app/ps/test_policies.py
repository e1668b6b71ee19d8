"""The PS policies (app.ps.policies), driven directly over their real parts.

Each test builds the state, the members, the reply buffers and the push counts as
ParameterServer does, has `policy_for` pick the strategy's policy, and takes pushes the way
`ParameterServer.submit` does: the policy returns whom to answer with what (`Ready`), and the
test completes those futures as the server does once its lock is released. What they guard:

- async: a push is applied at once and answered at once with the new state (a stale one
  scaled by 1 / staleness with staleness_lr);
- ssp: a pusher more than `staleness` pushes ahead of the slowest rank still training waits,
  and is answered once that rank pushes or is let go;
- sync: nothing is applied or answered until every rank still training pushed; their average is
  then one update, the same answer to all; a rank let go mid-round is left out of it;
- a rank's new process pushing while its old process's push waits: the old one is refused, stale;
- PolicyConfig refuses a strategy without a PS; policy_for picks each PS strategy's class.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.futures import Future

from app.exchange.wire import Push, Refusal, Refused, Reply
from app.ps.counts import PushCounts
from app.ps.members.members import Members, MembersConfig
from app.ps.policies import AsyncPolicy, BoundedPolicy, PolicyConfig, RoundPolicy, policy_for
from app.ps.policies.base import Ready
from app.ps.replies import ReplyBuffers
from app.ps.state import State, StateConfig

SIZE = 4  # the state: one Linear(4, 1) without bias, 4 parameters and no buffers


def values(*xs: float) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.float32)


def full(x: float) -> torch.Tensor:
    return torch.full((SIZE,), float(x))


class Parts:
    """A strategy's policy over the real parts, wired as ParameterServer wires them, with ranks
    1..`workers` joined."""

    def __init__(
        self,
        strategy: str,
        workers: int = 2,
        *,
        lr: float = 0.5,
        start: float = 1.0,
        staleness: int = 0,
        staleness_lr: bool = False,
        max_trainers: int = 0,
    ) -> None:
        model = nn.Linear(SIZE, 1, bias=False)
        nn.init.constant_(model.weight, start)
        self.state = State(model, StateConfig(lr, staleness_lr=staleness_lr))
        self.members = Members(MembersConfig(workers, max_trainers))
        self.replies = ReplyBuffers(self.state.size)
        self.counts = PushCounts()
        config = PolicyConfig(strategy, staleness)
        self.policy = policy_for(config, self.state, self.members, self.replies, self.counts)
        for rank in range(1, workers + 1):
            self.join(rank, f"worker{rank}")

    def join(self, rank: int, name: str) -> int:
        """`name` becomes rank's process (ParameterServer.join); the version its round counts from."""
        round_from = self.policy.admit(rank)
        self.members.join(rank, name, round_from)
        return round_from

    def take(self, rank: int, grads: torch.Tensor, pulled: int | None = None, name: str = "") -> tuple[Future, Ready]:
        """Rank's push of `grads`, computed on version `pulled` (default: the current one), taken
        as ParameterServer.submit takes it: the future of its answer, and the answers that may go."""
        name = name or f"worker{rank}"
        pulled = self.state.version if pulled is None else pulled
        self.members.seen(rank, name)
        future: Future = Future()
        staleness = self.state.version - pulled
        return future, self.policy.take(Push(rank, name, pulled), grads, future, staleness)


def answer(ready: Ready) -> None:
    """Complete the futures as the server does (app.ps.server._complete)."""
    for future, reply in ready:
        future.set_result(reply)


def answered(ready: Ready, *futures: Future) -> list[Reply]:
    """The replies `ready` gives, checked to go to exactly `futures`, in that order."""
    assert [f for f, _ in ready] == list(futures)
    return [reply for _, reply in ready]


# --- async ------------------------------------------------------------------------------------


def test_async_applies_a_push_at_once_and_answers_with_the_new_state():
    parts = Parts("async", workers=1, lr=0.5, start=1.0)
    future, ready = parts.take(1, values(2, 4, 6, 8))
    new = values(0, -1, -2, -3)  # 1 - 0.5 * grads
    assert parts.state.version == 1 and torch.equal(parts.state.vector, new)
    assert torch.equal(parts.state.model.weight.detach().flatten(), new)  # the model follows the state
    (reply,) = answered(ready, future)
    assert reply.version == 1 and reply.staleness == 0 and reply.lead == 0
    assert torch.equal(reply.vector, new)
    answer(ready)
    assert future.wait() is reply
    assert parts.counts.applied == 1 and parts.members.pushes == {1: 1}


def test_async_answers_a_stale_push_at_once_its_step_divided_by_its_staleness():
    parts = Parts("async", workers=2, lr=1.0, start=0.0, staleness_lr=True)
    for lead in (1, 2):  # rank 1 pushes twice on the newest state: full steps, w = -1, then -2
        future, ready = parts.take(1, full(1))
        assert answered(ready, future)[0].lead == lead
    stale, ready = parts.take(2, full(1), pulled=0)  # two updates late: half a step, w = -2.5
    (reply,) = answered(ready, stale)
    assert reply.version == 3 and reply.staleness == 2 and reply.lead == 0
    assert torch.equal(reply.vector, full(-2.5)) and torch.equal(parts.state.vector, full(-2.5))
    assert parts.counts.staleness_hist == {0: 2, 2: 1}


# --- ssp --------------------------------------------------------------------------------------


def test_ssp_holds_a_pusher_more_than_k_ahead_until_the_slowest_rank_pushes():
    parts = Parts("ssp", workers=2, staleness=1, lr=0.5, start=0.0)
    first, ready = parts.take(1, full(1))
    assert answered(ready, first)[0].lead == 1  # 1 ahead of rank 2: within the bound
    answer(ready)
    held, ready = parts.take(1, full(1))  # 2 ahead: applied at once, its answer waits
    assert ready == [] and not held.done()
    assert parts.state.version == 2 and torch.equal(parts.state.vector, full(-1.0))
    slow, ready = parts.take(2, full(1), pulled=0)
    released, reply = answered(ready, held, slow)
    assert released.version == reply.version == 3 and torch.equal(released.vector, full(-1.5))
    assert (released.lead, released.staleness) == (1, 0) and (reply.lead, reply.staleness) == (0, 2)
    answer(ready)
    assert held.wait() is released and slow.wait() is reply


def test_ssp_answers_a_held_pusher_once_the_slowest_rank_is_let_go():
    parts = Parts("ssp", workers=2, staleness=0, lr=0.5, start=0.0)
    held, ready = parts.take(1, full(2))
    assert ready == [] and parts.state.version == 1  # applied, 1 ahead of rank 2: waits
    assert parts.members.drop(2, "worker2")  # as ParameterServer.drop: the members, then the policy
    (reply,) = answered(parts.policy.let_go(2), held)
    assert reply.version == 1 and reply.lead == 0 and torch.equal(reply.vector, full(-1.0))


# --- sync -------------------------------------------------------------------------------------


def test_sync_applies_nothing_until_every_rank_pushed_then_one_averaged_update_answers_all():
    parts = Parts("sync", workers=2, lr=0.5, start=1.0)
    first, ready = parts.take(1, values(2, 0, 4, -2))
    assert ready == [] and not first.done()
    assert parts.state.version == 0 and torch.equal(parts.state.vector, full(1.0))
    assert parts.counts.applied == 0 and parts.members.pushes == {}
    second, ready = parts.take(2, values(4, 2, 0, 2))
    a, b = answered(ready, first, second)
    new = values(-0.5, 0.5, 0, 1)  # 1 - 0.5 * mean = 1 - 0.5 * (3, 1, 2, 0)
    assert parts.state.version == 1 and torch.equal(parts.state.vector, new)
    assert a.version == b.version == 1 and a.vector is b.vector and torch.equal(a.vector, new)
    assert (a.staleness, a.lead, b.staleness, b.lead) == (0, 0, 0, 0)
    assert parts.counts.applied == 2 and parts.members.pushes == {1: 1, 2: 1}
    answer(ready)
    assert first.wait() is a and second.wait() is b


def test_sync_round_closes_without_a_rank_let_go_before_it_pushed():
    parts = Parts("sync", workers=3, lr=0.5, start=1.0)
    first, ready = parts.take(1, full(2))
    assert ready == []
    second, ready = parts.take(2, full(4))
    assert ready == [] and parts.state.version == 0  # the round waits for rank 3
    assert parts.members.drop(3, "worker3")
    a, b = answered(parts.policy.let_go(3), first, second)
    # the mean of the two pushes made (3), not their sum over the three ranks the round began with
    assert a.version == b.version == parts.state.version == 1
    assert torch.equal(a.vector, full(-0.5)) and torch.equal(parts.state.vector, full(-0.5))


def test_sync_round_leaves_out_the_push_of_a_rank_let_go_mid_round():
    parts = Parts("sync", workers=3, lr=0.5, start=1.0)
    first, _ = parts.take(1, full(2))
    dropped, _ = parts.take(2, full(100))
    assert parts.members.drop(2, "worker2")
    (reply,) = answered(parts.policy.let_go(2), dropped)  # the state as it is: its push not applied
    assert reply.version == 0 and torch.equal(reply.vector, full(1.0)) and not first.done()
    last, ready = parts.take(3, full(4))
    a, b = answered(ready, first, last)
    assert a.version == b.version == 1 and torch.equal(a.vector, full(-0.5))  # 1 - 0.5 * mean(2, 4)
    assert parts.members.pushes == {1: 1, 3: 1}


def test_sync_counts_a_rank_that_joins_mid_round_from_the_next_round_on():
    parts = Parts("sync", workers=2, lr=0.5, start=1.0, max_trainers=3)
    first, _ = parts.take(1, full(2))
    assert parts.join(3, "worker3") == 1  # scaled up while a round is open: counted from version 1
    second, ready = parts.take(2, full(4))
    a, _ = answered(ready, first, second)
    assert a.version == 1 and torch.equal(a.vector, full(-0.5))
    assert parts.members.training(parts.state.version) == [1, 2, 3]  # the next round waits for it


# --- a rank's new process ---------------------------------------------------------------------


def test_a_new_process_pushing_while_the_old_ones_push_waits_refuses_the_old_one_as_stale():
    parts = Parts("sync", workers=2, lr=0.5, start=1.0)
    old, ready = parts.take(1, full(50))
    assert ready == []
    parts.join(1, "worker1-b")  # its old process died waiting
    new, ready = parts.take(1, full(2), name="worker1-b")
    assert ready == [] and not new.done()
    assert old.done()  # refused at once by the policy itself (Policy.hold), not through Ready
    refusal = old.wait()
    assert isinstance(refusal, Refusal) and refusal.kind is Refused.STALE and "worker1" in refusal.message
    other, ready = parts.take(2, full(4))
    a, b = answered(ready, new, other)
    assert a.version == 1 and torch.equal(a.vector, full(-0.5))  # 1 - 0.5 * mean(2, 4): the old push left out


# --- the config ---------------------------------------------------------------------------------


def test_policy_config_refuses_a_strategy_without_a_ps():
    with pytest.raises(ValueError, match="allreduce"):
        PolicyConfig("allreduce")


@pytest.mark.parametrize(("strategy", "kind"), [("async", AsyncPolicy), ("ssp", BoundedPolicy), ("sync", RoundPolicy)])
def test_policy_for_picks_the_class_of_each_ps_strategy(strategy, kind):
    parts = Parts(strategy)
    assert type(parts.policy) is kind


def test_policy_for_gives_ssp_its_bound():
    parts = Parts("ssp")
    args = (parts.state, parts.members, parts.replies, parts.counts)
    ssp = policy_for(PolicyConfig("ssp", staleness=3), *args)
    assert isinstance(ssp, BoundedPolicy) and ssp.bound == 3
