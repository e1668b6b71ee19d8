"""Who trains: one entry per worker rank, with its current incarnation and progress.

Pure Python, no RPC and no lock of its own: the ParameterServer calls it
under its lock, so progress and the model version always match in a
checkpoint. A rank is `absent` (not joined yet), `live`, `finished`,
`dropped` (its incarnation died or stopped answering) or `left` (it was
scaled down: it said so before it exited, or its process said before it joined that it
ended cleanly; nobody waits for it). A restarted process
of the same rank joins under a new RPC name (`worker1`, `worker1_r2`, ...)
and resumes the rank's progress.

Invariant: a rank is `finished` only while the process that finished its
epochs in this run is its latest one. A join or a call from the rank makes it
`live` again (a new process of a finished rank resumes at its recorded
progress: it trains what is left, or finishes at once), and a checkpoint of
another run restores each rank's progress but never its finish.

Scaling: ranks 1..N are the job's from the start; ranks N+1..`max_rank` are
admitted when they join (a running job scaled up) and waited for only from
then on. A rank that left is waited for by nobody; the run is done once every
rank finished or left, and at least one finished (a job whose every rank left,
as on a stop of the whole cluster, waits for them to come back).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from app.exchange.wire import Progress

ABSENT, LIVE, FINISHED, DROPPED, LEFT = "absent", "live", "finished", "dropped", "left"


class StaleIncarnation(RuntimeError):
    """A call from an incarnation that a newer process of the same rank replaced, or that left
    the job (scaled down)."""


@dataclass
class Member:
    rank: int
    name: str = ""  # RPC name of the current incarnation
    state: str = ABSENT
    since: float = 0.0  # monotonic time of the last state change
    last_seen: float = 0.0  # monotonic time of the last call from it
    epoch: int = 1  # progress: `batch` batches of `epoch` are done
    batch: int = 0
    pushes: int = 0
    joins: int = 0
    round_from: int = 0  # sync: the first version whose round counts this rank (it joined mid-round)
    to_go: int = -1  # pushes the rank has still to make after its last one applied; -1: unknown

    def progress(self) -> Progress:
        return Progress(self.epoch, self.batch, self.pushes)


class Roster:
    """The workers the PS waits for, and when it may stop waiting."""

    def __init__(
        self,
        ranks: Iterable[int],
        join_timeout: float,
        clock: Callable[[], float] = time.monotonic,
        max_rank: int = 0,
    ) -> None:
        self.clock, self.join_timeout = clock, join_timeout
        now = clock()
        self.members = {r: Member(r, since=now, last_seen=now) for r in ranks}
        self.max_rank = max(max_rank, *self.members)  # ranks above the first ones join when scaled up
        self.closed = False  # no worker can join (a sharded PS with a shard down): nobody times out

    def __getitem__(self, rank: int) -> Member:
        if rank not in self.members:
            raise ValueError(f"rank {rank} is not a worker of this job (ranks {min(self.members)}..{self.max_rank})")
        return self.members[rank]

    def join(self, rank: int, name: str) -> Member:
        """`name` is now rank's incarnation; it resumes the rank's progress. A rank above the
        first ones (up to max_rank) becomes a member here: the job was scaled up, and the new rank
        starts at the epoch after the one the slowest live rank is in (the job's next epoch, of
        which it takes a fair share), not at epoch 1."""
        if rank not in self.members and 1 <= rank <= self.max_rank:
            epochs = [m.epoch for m in self.live()]
            self.members[rank] = Member(rank, since=self.clock(), last_seen=self.clock())
            self.members[rank].epoch = min(epochs) + 1 if epochs else 1
        m = self[rank]
        m.name, m.joins = name, m.joins + 1
        self._set(m, LIVE)
        return m

    def seen(self, rank: int, name: str) -> bool:
        """A call from `name`: refuse a replaced incarnation or one that left; True when it
        readmits a dropped (or finished: it trains after all) one."""
        m = self[rank]
        if m.name and m.name != name:
            raise StaleIncarnation(f"{name} was replaced by {m.name} for rank {rank}; exiting")
        if m.state == LEFT:  # e.g. a push still on the wire when it left: it trains no more
            raise StaleIncarnation(f"{name} left the job (rank {rank}); a call after that is not taken")
        m.last_seen = self.clock()
        if m.state in (DROPPED, FINISHED):
            m.name = name
            self._set(m, LIVE)
            return True
        return False

    def record_push(self, rank: int, epoch: int, batch: int, to_go: int = -1) -> None:
        m = self.members[rank]
        m.epoch, m.batch, m.pushes, m.to_go = epoch, batch, m.pushes + 1, to_go

    def finish(self, rank: int, name: str) -> None:
        self.seen(rank, name)
        self._set(self.members[rank], FINISHED)

    def leave(self, rank: int, name: str) -> None:
        """`name` leaves the job for good (scaled down): nobody waits for the rank any more."""
        self.seen(rank, name)
        self._set(self.members[rank], LEFT)

    def withdraw(self, rank: int) -> bool:
        """A process of `rank` ended cleanly before it joined (scaled down, or its code exited 0):
        nobody waits for the rank any more, as for one that left. False, and nothing changes,
        unless the rank is one the job waits to join (absent, or dropped): a rank live again
        by now (a new process joined) or finished keeps its state."""
        m = self.members.get(rank)
        if m is None or m.state not in (ABSENT, DROPPED):
            return False
        self._set(m, LEFT)
        return True

    def drop(self, rank: int, name: str) -> bool:
        """Stop waiting for incarnation `name`; False when it is no longer rank's live one."""
        m = self.members.get(rank)
        if m is None or m.name != name or m.state != LIVE:
            return False
        self._set(m, DROPPED)
        return True

    def live(self) -> list[Member]:
        return [m for m in self.members.values() if m.state == LIVE]

    def left(self) -> list[Member]:
        return [m for m in self.members.values() if m.state == LEFT]

    @property
    def all_finished(self) -> bool:
        """Every rank finished or left (scaled down), and at least one finished."""
        states = [m.state for m in self.members.values()]
        return FINISHED in states and all(s in (FINISHED, LEFT) for s in states)

    def open(self) -> None:
        """Workers can join from now on (the PS listens, every shard is up): each rank not in the
        job (absent, or dropped) is waited for a whole join_timeout from now, not from when this
        roster was made: a loaded host can spend most of a short join_timeout starting the PS or
        a shard, and a PS that then gave up on workers that could not join yet would exit 1."""
        now = self.clock()
        self.closed = False
        for m in self.members.values():
            if m.state in (ABSENT, DROPPED):
                m.since = now

    def close(self) -> None:
        """No worker can join until `open` (a sharded PS whose shards are not all up): the ranks
        not in the job are not counted missing meanwhile, however long it takes."""
        self.closed = True

    def missing(self) -> list[Member]:
        """Ranks that are neither live nor finished, and have been so for join_timeout while
        workers could join."""
        if self.closed:
            return []
        now = self.clock()
        return [m for m in self.members.values() if m.state in (ABSENT, DROPPED) and now - m.since >= self.join_timeout]

    def done(self) -> bool:
        """Every rank finished, or nobody trains and every unfinished rank is past join_timeout."""
        if self.all_finished:
            return True
        unfinished = [m for m in self.members.values() if m.state not in (FINISHED, LEFT)]
        if not unfinished:  # every rank left (the cluster stops) or left and none finished: wait for them
            return False
        return not self.live() and len(self.missing()) == len(unfinished)

    def counts(self) -> str:
        live = len(self.live())
        finished = sum(m.state == FINISHED for m in self.members.values())
        left = len(self.left())
        return f"{live} live, {finished} finished{f', {left} left' if left else ''} of {len(self.members)}"

    def state(self) -> dict[int, dict[str, int]]:
        """Per-rank progress for a checkpoint."""
        return {
            r: {**m.progress()._asdict(), "finished": int(m.state == FINISHED), "left": int(m.state == LEFT)}
            for r, m in self.members.items()
        }

    def restore(self, state: dict[int, dict[str, int]], same_run: bool = True) -> None:
        """Progress from a checkpoint; every rank must join again. A rank finished (or left) in it
        stays so only when the checkpoint is of this run (`same_run`: a restarted PS, whose
        finished or scaled-down workers have exited and will not join again). A rank above the
        first ones (scaled up) is restored only when the checkpoint is of this run."""
        for rank, p in state.items():
            if rank not in self.members and rank <= self.max_rank and same_run:
                self.members[rank] = Member(rank, since=self.clock(), last_seen=self.clock())
            if rank in self.members:
                m = self.members[rank]
                m.epoch, m.batch, m.pushes = p["epoch"], p["batch"], p["pushes"]
                if p.get("finished") and same_run:
                    self._set(m, FINISHED)
                elif p.get("left") and same_run:
                    self._set(m, LEFT)

    def _set(self, m: Member, state: str) -> None:
        m.state, m.since = state, self.clock()
