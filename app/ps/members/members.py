"""Who trains, as the PS acts on it: the roster (app.ps.members.roster) and what follows from it:
the ranks a push waits for, how far a rank leads the slowest, what a rank trains next in a job
that may be scaled (app.ps.members.epochs), the live processes and the frozen ones, when
training started, and when the job is done.

No lock of its own: app.ps.server calls it under its lock, and the strategy's policy
(app.ps.policies) reads it there. A sync round counts a rank from `round_from` on (it joined
while a round was open that did not wait for it): the ranks training depend on the state's
version, which the caller gives.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from app.exchange.wire import Share
from app.ps.members.epochs import EpochShares
from app.ps.members.roster import ABSENT, FINISHED, LIVE, Member, Roster


@dataclass(frozen=True)
class MembersConfig:
    """The job's ranks: 1..`num_trainers` from the start, up to `max_trainers` when it is scaled
    up; how long a missing rank is waited for; the run (a checkpoint of another run restores no
    finish); the epochs the job trains."""

    num_trainers: int
    max_trainers: int = 0
    join_timeout: float = float("inf")
    run_id: str = ""
    num_epochs: int = 1


class Members:
    """The job's workers: who is live, finished, dropped or left, and what the PS waits for."""

    def __init__(self, config: MembersConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config, self.clock = config, clock
        ranks = range(1, config.num_trainers + 1)
        self.roster = Roster(ranks, config.join_timeout, clock, max_rank=config.max_trainers)
        self.epochs = EpochShares(config.num_epochs)  # who trains which share of each epoch
        self.first_join: float | None = None  # clock time of the first join
        self.all_joined: float | None = None  # clock time every rank had joined (or finished)
        self.finishing = 0  # finishes being recorded (on_finish): the job is not done before they are

    def join(self, rank: int, name: str, round_from: int = 0) -> Member:
        """`name` becomes rank's process; a sync round counts it from version `round_from` on."""
        member = self.roster.join(rank, name)
        member.last_seen = self.clock()
        member.round_from = round_from
        self.first_join = self.first_join or self.clock()
        if self.all_joined is None and all(m.joins or m.state == FINISHED for m in self.roster.members.values()):
            self.all_joined = self.clock()
        return member

    def open(self) -> None:
        """Joins can reach the PS from now on (app.ps.members.roster.Roster.open)."""
        self.roster.open()

    def close(self) -> None:
        """No join can reach the PS until `open` (app.ps.members.roster.Roster.close)."""
        self.roster.close()

    def joins(self, rank: int) -> int | None:
        """How many processes of `rank` joined (its last one's notes carry it); None: no member."""
        member = self.roster.members.get(rank)
        return member.joins if member is not None else None

    def seen(self, rank: int, name: str) -> bool:
        """A call from `name` (app.ps.members.roster.Roster.seen): True when it readmits the rank."""
        return self.roster.seen(rank, name)

    def record_push(self, rank: int, epoch: int, batch: int, to_go: int = -1) -> None:
        self.roster.record_push(rank, epoch, batch, to_go)
        self.epochs.record(rank, epoch, batch)

    def finish(self, rank: int, name: str) -> None:
        self.roster.finish(rank, name)

    def leave(self, rank: int, name: str) -> None:
        self.roster.leave(rank, name)
        self.epochs.release(rank)

    def withdraw(self, rank: int) -> bool:
        """A process of `rank` ended cleanly before it joined (app.ps.members.roster.Roster.withdraw)."""
        if not self.roster.withdraw(rank):
            return False
        self.epochs.release(rank)
        return True

    def drop(self, rank: int, name: str) -> bool:
        return self.roster.drop(rank, name)

    def training(self, version: int) -> list[int]:
        """Ranks ssp and sync wait for at `version`: live ones (a sync round counts one from its
        `round_from` on), and those yet to join within join_timeout (not finished, not dropped)."""
        missing = {m.rank for m in self.roster.missing()}
        return [
            m.rank
            for m in self.roster.members.values()
            if (m.state == LIVE and m.round_from <= version) or (m.state == ABSENT and m.rank not in missing)
        ]

    def lead(self, rank: int, version: int) -> int:
        """How many pushes rank is ahead of the slowest rank still training."""
        pushes = [self.roster.members[r].pushes for r in self.training(version)]
        return self.roster.members[rank].pushes - min(pushes) if pushes else 0

    def share(self, rank: int, finished: Share | None, version: int) -> Share | None:
        """What rank trains next, having trained `finished` (app.ps.members.epochs): a new epoch
        is split among the ranks training now (those ssp and sync wait for, the live ones, and
        rank itself); shares of ranks that left or are missing go to whoever asks."""
        ranks = {*self.training(version), *(m.rank for m in self.roster.live()), rank}
        gone = {m.rank for m in self.roster.left()} | {m.rank for m in self.roster.missing()}
        return self.epochs.next(rank, finished, sorted(ranks), gone)

    def updates_left(self, rounds: bool) -> int | None:
        """The updates still to come, as the ranks' last pushes planned them: each rank still
        expected to train (live, or yet to join within join_timeout) has `to_go` pushes left;
        async and ssp apply each push (their sum), sync one update a round of every rank still
        training (the most any rank has left). Finished, left, dropped and missing ranks add
        none. None when a rank expected to train has not said (not pushed yet, or -1: a job that
        may be scaled, whose shares are handed out as it goes)."""
        missing = {m.rank for m in self.roster.missing()}
        left = []
        for m in self.roster.members.values():
            if m.state == LIVE or (m.state == ABSENT and m.rank not in missing):
                if m.to_go < 0:
                    return None
                left.append(m.to_go)
        if not left:
            return 0
        return max(left) if rounds else sum(left)

    def live_name(self, rank: int) -> str | None:
        """The RPC name of rank's live process, if one is live."""
        if rank not in self.roster.members and 1 <= rank <= self.roster.max_rank:
            return None  # a rank of a job scaled up, not joined yet
        member = self.roster[rank]
        return member.name if member.state == LIVE else None

    def live(self) -> list[tuple[int, str, float]]:
        """(rank, name, last call time) of every live process."""
        return [(m.rank, m.name, m.last_seen) for m in self.roster.live()]

    def live_count(self) -> int:
        return len(self.roster.live())

    def frozen(self, limit: float, waiting: Collection[int]) -> list[tuple[int, str, float]]:
        """(rank, name, seconds quiet) of live ranks that have not called for `limit` seconds and
        are not waiting for an answer to a push (ranks `waiting`)."""
        now = self.clock()
        return [
            (m.rank, m.name, now - m.last_seen)
            for m in self.roster.live()
            if m.rank not in waiting and now - m.last_seen >= limit
        ]

    def training_seconds(self, last_applied: float | None) -> float | None:
        """From every rank joined (or, if one never did, the first join) to `last_applied`."""
        start = self.all_joined if self.all_joined is not None else self.first_join
        if start is None or last_applied is None:
            return None
        return max(0.0, last_applied - start)

    @property
    def pushes(self) -> dict[int, int]:
        return {r: m.pushes for r, m in self.roster.members.items() if m.pushes}

    @property
    def finished(self) -> dict[int, int]:
        return {r: m.pushes for r, m in self.roster.members.items() if m.state == FINISHED}

    @property
    def all_finished(self) -> bool:
        return self.roster.all_finished

    def done(self) -> bool:
        """Every rank finished (and recorded), or no one trains and the missing ones are past
        join_timeout."""
        return self.finishing == 0 and self.roster.done()

    def summary(self) -> str:
        """e.g. `1 live, 2 finished of 3`."""
        return self.roster.counts()

    def checkpoint(self) -> dict[str, Any]:
        """Each rank's progress, its pushes, whether every rank finished, and (a job that may be
        scaled) who trained which share of each epoch."""
        saved = {"progress": self.roster.state(), "pushes": self.pushes, "finished": self.roster.all_finished}
        return {**saved, "epochs": self.epochs.state()} if self.epochs.used() else saved

    def restore(self, saved: dict[str, Any]) -> None:
        """Each rank's progress from a checkpoint; its finishes only when it is of this run. Without
        epochs' shares in it, the epochs before the earliest a rank is in count as done."""
        self.roster.restore(saved["progress"], same_run=saved.get("run_id", "") == self.config.run_id)
        first = min((m.epoch for m in self.roster.members.values()), default=1)
        self.epochs.restore(saved.get("epochs"), first_epoch=first)
