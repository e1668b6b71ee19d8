"""The Parameter Server of one PS process: its parts, wired under one lock.

- the state (app.ps.state): the vector [params | buffers] this process serves, SGD, the version;
- the members (app.ps.members.members): who trains, how far each rank got, whom a push waits for;
- the policy (app.ps.policies): async, ssp or sync, when a push is applied and its answer goes;
- the reply buffers (app.ps.replies) and the push counts (app.ps.counts).

`ParameterServer` is plain Python (tested without RPC); the RPC endpoints workers call are
app.ps.rpc, the PS process app.ps.process. Workers join, pull, push and report; the PS calls a
worker only to ping it (app.ps.members.liveness). A sharded PS (app.ps.sharding.slices) runs one
ParameterServer per process over a slice `part` of the state vector: pushes, replies and
checkpoints are that slice.

`submit` returns a future of the push's answer (`rpc_push` is `async_execution`, so an answer
the policy keeps waiting ties up no RPC thread). A push the PS will not apply is answered with a
`Refusal` value, never an exception (RPC would carry an exception set on the future back as a
plain value): `stale` (a newer process of the rank replaced the pusher: it exits) or `nonfinite`
(NaN/inf in the push: nothing applied, the worker skips the batch).

Every part changes under the one lock, so a checkpoint's progress matches its version; futures
are completed after it is released, so sending answers never holds up a push, except a streamed
answer (`submit`), which goes with the lock held while the rest of its state is written.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.futures import Future

from app.config import Config
from app.contract import strategy_of, worker_name
from app.exchange import ps_end as exchange
from app.exchange.ps_end import NO_SEGMENT, PSEnd
from app.exchange.wire import Joined, Push, Refusal, Refused, Share
from app.ps.counts import PushCounts
from app.ps.members.members import Members, MembersConfig
from app.ps.members.roster import StaleIncarnation
from app.ps.policies import PolicyConfig, policy_for
from app.ps.policies.base import Ready, Stream
from app.ps.readings import Readings
from app.ps.replies import ReplyBuffers
from app.ps.state import Plan, State, StateConfig
from app.recipes import outer_optimizer
from app.runtime.words import counted

log = logging.getLogger("app.ps")
NONFINITE = (
    "%s pushed non-finite values (NaN or inf); refused, the model is unchanged "
    "(further refusals of it are counted, not logged)"
)


@dataclass(frozen=True)
class ServerConfig:
    """Each part's settings."""

    state: StateConfig
    members: MembersConfig
    policy: PolicyConfig = field(default_factory=PolicyConfig)

    @classmethod
    def from_config(cls, config: Config, part: tuple[int, int] | None = None) -> ServerConfig:
        """The settings of the job `config` describes, for the PS process serving `part` of the
        state (None: all of it)."""
        plan = Plan(config.strategy, config.epochs, config.num_trainers, config.max_steps, config.local_steps)
        members = MembersConfig(
            config.num_trainers, config.max_trainers, config.join_timeout, config.run_id, config.epochs
        )
        policy = PolicyConfig(config.strategy, config.staleness)
        kind = strategy_of(config.strategy)
        if kind.local:  # each push is a change, stepped by the outer optimizer at its own rate, unscheduled
            outer = outer_optimizer(config.outer_optimizer, not kind.rounds, config.num_trainers)
            state = StateConfig(float(outer["lr"]), part=part, optimizer=outer, plan=plan, metrics=config.metrics)
            return cls(state, members, policy)
        state = StateConfig(
            config.lr,
            config.momentum,
            config.weight_decay,
            config.staleness_lr,
            part,
            config.optimizer,
            config.schedule,
            config.clip_grad_norm,
            plan,
            config.metrics,
        )
        return cls(state, members, policy)


class ParameterServer(Readings):
    """The state, the members and the strategy's policy of one PS process, under one lock."""

    @classmethod
    def from_config(
        cls,
        config: Config,
        model: nn.Module,
        part: tuple[int, int] | None,
        who: str,
        on_finish: Callable[[int], None] | None = None,
    ) -> ParameterServer:
        """The PS process `who` (the main PS, or a shard serving `part` of the state) of the job
        `config` describes, over `model`'s state, with its shared-memory segment where the
        exchange can have one (app.exchange.ps_end); `on_finish(rank)` after a rank finished."""
        shared = exchange.for_config(config, model, part, who)
        return cls(model, ServerConfig.from_config(config, part), shared=shared, on_finish=on_finish)

    def __init__(
        self,
        model: nn.Module,
        config: ServerConfig,
        shared: PSEnd = NO_SEGMENT,
        clock: Callable[[], float] = time.monotonic,
        on_finish: Callable[[int], None] | None = None,
    ) -> None:
        self.config, self.shared = config, shared
        self.state = State(model, config.state, clock)
        self.members = Members(config.members, clock)
        self.counts = PushCounts()
        self.replies = ReplyBuffers(self.state.size, shared)  # per rank, used in turn
        self.policy = policy_for(config.policy, self.state, self.members, self.replies, self.counts)
        self.waits, self.rounds = config.policy.kind.waits, config.policy.kind.rounds
        if not self.state.sliced:  # where a worker may wait for each partition of its answer
            self.state.parts = shared.streamed_parts([p.numel() for p in model.parameters()])
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._events = 0  # joins, finishes, drops: they wake `wait`
        self._wake_at = 0
        # Called outside the lock: a dropped process called again, a process left the job for good
        # (app.ps.members.liveness records both), a rank finished (the PS process checkpoints
        # then, before the finishing worker gets its answer, so a finish outlives a PS crash).
        self.on_back: Callable[[int, str], None] = lambda rank, name: None
        self.on_leave: Callable[[int, str], None] = lambda rank, name: None
        self.on_finish: Callable[[int], None] = on_finish or (lambda rank: None)
        # A push that carries its worker's training loss (Push.loss): (name, the version then,
        # loss, samples/s); the main PS logs it to MLflow.
        self.on_report: Callable[[str, int, float, float | None], None] = lambda name, version, loss, rate: None

    @property
    def version(self) -> int:
        return self.state.version

    # The calls workers make (app.ps.rpc).

    def join(self, rank: int, name: str) -> Joined:
        """`name` becomes rank's process: the state, its version and where the rank resumes."""
        with self._lock:
            round_from = self.policy.admit(rank)
            member = self.members.join(rank, name, round_from)
            self._event()
            return Joined(self.state.vector.clone(), self.state.version, member.progress())

    def observe(self, headline: float) -> bool:
        """An evaluation's headline, for a plateau schedule (app.ps.plateau); whether the rate fell."""
        with self._lock:
            return self.state.observe(headline)

    def pull(self, rank: int) -> tuple[torch.Tensor, int]:
        """A copy of the state vector and its version."""
        with self._lock:
            return self.state.copy()

    def submit(
        self,
        push: Push,
        message: torch.Tensor,
        stream: Stream | None = None,
        after: Callable[[Callable[[], None]], None] | None = None,
    ) -> Future:
        """Take one worker's `message` ([grads | buffers]) and what `push` says of it
        (app.exchange.wire.Push); a future of its Reply (or Refusal). A reply's vector is one of
        rank's (or the round's) reply buffers (app.ps.replies), not a fresh copy: it stays
        unchanged until rank's next push at the earliest.

        A push whose worker waits for each partition of its reply (`push.streamed`), given the
        reply buffers' words (`stream`, app.exchange.ps_end), may be answered once the first
        partition is written: the future is done when this returns, and the rest is written, the
        lock still held, by the work handed to `after` (app.exchange.transport.after_reply: once
        the answer has gone), or before this returns without `after`."""
        message = self.state.message(push.rank, message)
        name = push.name or worker_name(push.rank)
        # a GPU worker's flags say finite where it computed them (app.exchange.slot_copies): not checked again
        finite = push.finite or self.state.finite(message)  # outside the lock
        future: Future = Future()
        ready: Ready = []
        version = -1
        self._lock.acquire()
        try:
            try:
                readmitted = self.members.seen(push.rank, name)
            except StaleIncarnation as error:
                log.info("push not applied: %s", error)
                future.set_result(Refusal(Refused.STALE, str(error)))
                self._lock.release()
                return future
            if finite:
                self.state.plan(push.epoch_batches)
                self.counts.samples += push.samples
                staleness = self.state.version - push.pulled if push.staleness is None else push.staleness
                streaming = stream if push.streamed and not readmitted else None
                ready = self.policy.take(push, message, future, staleness, streaming)
                self._moved()
                version = self.state.version
            elif self.counts.refuse(push.rank):
                log.warning(NONFINITE, name)  # once per rank
            if readmitted:
                self._changed.notify_all()
        except BaseException:
            self.state.finish()
            self._lock.release()
            raise
        if not finite:
            refused = f"{name} pushed non-finite values (NaN or inf); the push was refused"
            future.set_result(Refusal(Refused.NONFINITE, refused))

        def told() -> None:  # outside the lock
            if readmitted:
                self.on_back(push.rank, name)
            if push.loss is not None and version >= 0:
                self.on_report(name, version, push.loss, push.samples_per_s)

        if not self.state.unfinished:
            self._lock.release()
            _complete(ready)
            told()
            return future

        def rest() -> None:
            try:
                self.state.finish()
            finally:
                self._lock.release()
            told()

        _complete(ready)  # a streamed answer goes with its first partition written, the lock held
        if after is None:
            rest()
        else:
            after(rest)
        return future

    def finish(self, rank: int, pushes: int, name: str = "") -> Refusal | None:
        """A worker has run all its epochs; recorded durably (on_finish) before it returns.
        A Refusal when a newer process replaced `name`."""
        name = name or worker_name(rank)
        with self._lock:
            try:
                self.members.finish(rank, name)
            except StaleIncarnation as error:
                return Refusal(Refused.STALE, str(error))
            self.members.finishing += 1
            summary = self.members.summary()
            ready = self.policy.unblock()
            self._moved()
        _complete(ready)
        log.info("%s finished after %s (%s)", name, counted(pushes, "push", "pushes"), summary)
        try:
            self.on_finish(rank)
        finally:
            with self._lock:
                self.members.finishing -= 1
                self._event()
        return None

    def leave(self, rank: int, pushes: int, name: str = "") -> Refusal | None:
        """`name` leaves the job for good (scaled down, after its last push was answered): nobody
        waits for its rank any more (a sync round shrinks, ssp's bound follows the others).
        A Refusal when a newer process replaced `name`."""
        name = name or worker_name(rank)
        with self._lock:
            try:
                self.members.leave(rank, name)
            except StaleIncarnation as error:
                return Refusal(Refused.STALE, str(error))
            ready = self.policy.let_go(rank)
            self._event()
            summary = self.members.summary()
        _complete(ready)
        log.info("%s left after %s (%s)", name, counted(pushes, "push", "pushes"), summary)
        self.on_leave(rank, name)
        return None

    def share(self, rank: int, finished: Share | None = None) -> Share | None:
        """What rank trains next, having trained `finished` (app.ps.members.epochs); None: nothing
        is left of the job's epochs."""
        with self._lock:
            return self.members.share(rank, finished, self.state.version)

    # What the PS process does (app.ps.process, app.ps.members.liveness).

    def drop(self, rank: int, name: str | None) -> bool:
        """Stop waiting for `name`; False when it is not rank's live process (any more). Its push
        waiting for an answer gets the current state (ssp: it was applied; sync: it was not, and
        the round goes on without it): if it is alive after all, its next call readmits it.
        `name` None: a process of rank ended cleanly before it joined (app.exchange.group's
        say_not_joining): the rank is left, unless it is live or finished by now (False)."""
        with self._lock:
            if not (self.members.drop(rank, name) if name is not None else self.members.withdraw(rank)):
                return False
            ready = self.policy.let_go(rank)
            self._event()
        _complete(ready)
        return True

    def open_joins(self) -> None:
        """Workers can join from now on: the ranks not in the job get their whole join_timeout
        from now (the PS process calls it once it listens, and a sharded PS whenever its shards
        are all up again)."""
        with self._lock:
            self.members.open()

    def close_joins(self) -> None:
        """No worker can join until `open_joins` (a sharded PS whose shards are not all up): no
        rank's join_timeout runs meanwhile."""
        with self._lock:
            self.members.close()

    def unblock(self) -> None:
        """Answer waiting pushes that no longer wait for anyone (a rank past join_timeout);
        the PS process calls it every tick."""
        with self._lock:
            ready = self.policy.unblock()
            self._moved()
        _complete(ready)

    def wait(self, until_version: int, timeout: float) -> None:
        """Block until the version reaches `until_version`, a worker joins, finishes or
        is dropped, or timeout."""
        with self._changed:
            events, self._wake_at = self._events, until_version
            self._changed.wait_for(
                lambda: (
                    self._events != events
                    or self.state.version >= until_version
                    or (self.members.all_finished and not self.members.finishing)
                ),
                timeout,
            )

    def snapshot(self) -> tuple[torch.Tensor, int]:
        return self.pull(rank=0)

    def evaluated(self) -> tuple[torch.Tensor, int, float]:
        """A copy of the state vector, its version and the learning rate at that version (what
        an evaluation line reports, however far training has gone on while it evaluates)."""
        with self._lock:
            vector, version = self.state.copy()
            return vector, version, self.state.lr

    def checkpoint(self) -> dict[str, Any]:
        """The state (app.ps.state) and each rank's progress, copied under the lock."""
        with self._lock:
            return {**self.state.checkpoint(), **self.members.checkpoint()}

    def restore(self, saved: dict[str, Any]) -> None:
        """Continue from a checkpoint (written by `checkpoint`)."""
        with self._lock:
            self.state.restore(saved)
            self.members.restore(saved)

    def _moved(self) -> None:
        """The policy may have applied an update: wake `wait` if it waits for this version."""
        if self.state.version >= self._wake_at:
            self._changed.notify_all()

    def _event(self) -> None:
        self._events += 1
        self._changed.notify_all()


def _complete(ready: Ready) -> None:
    """Send the answers that may go (outside the lock: completing a future runs RPC's callbacks)."""
    for future, reply in ready:
        future.set_result(reply)
