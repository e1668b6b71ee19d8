"""Who trains: one entry per worker rank, with its current incarnation and progress.

Pure Python, no RPC and no lock of its own: the ParameterServer calls it
under its lock, so progress and the model version always match in a
checkpoint. A rank is `absent` (not joined yet), `live`, `finished` or
`dropped` (its incarnation died or stopped answering). A restarted process
of the same rank joins under a new RPC name (`worker1`, `worker1_r2`, ...)
and resumes the rank's progress.

Invariant: a rank is `finished` only while the process that finished its
epochs in this run is its latest one. A join or a call from the rank makes it
`live` again (a new process of a finished rank resumes at its recorded
progress: it trains what is left, or finishes at once), and a checkpoint of
another run restores each rank's progress but never its finish.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

ABSENT, LIVE, FINISHED, DROPPED = "absent", "live", "finished", "dropped"


class StaleIncarnation(RuntimeError):
    """A call from an incarnation that a newer process of the same rank replaced."""


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

    def progress(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batch": self.batch, "pushes": self.pushes}


class Roster:
    """The workers the PS waits for, and when it may stop waiting."""

    def __init__(self, ranks: Iterable[int], join_timeout: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock, self.join_timeout = clock, join_timeout
        now = clock()
        self.members = {r: Member(r, since=now, last_seen=now) for r in ranks}

    def __getitem__(self, rank: int) -> Member:
        if rank not in self.members:
            raise ValueError(
                f"rank {rank} is not a worker of this job (ranks {min(self.members)}..{max(self.members)})"
            )
        return self.members[rank]

    def join(self, rank: int, name: str) -> Member:
        """`name` is now rank's incarnation; it resumes the rank's progress."""
        m = self[rank]
        m.name, m.joins = name, m.joins + 1
        self._set(m, LIVE)
        return m

    def seen(self, rank: int, name: str) -> bool:
        """A call from `name`: refuse a replaced incarnation; True when it readmits a dropped
        (or finished: it trains after all) one."""
        m = self[rank]
        if m.name and m.name != name:
            raise StaleIncarnation(f"{name} was replaced by {m.name} for rank {rank}; exiting")
        m.last_seen = self.clock()
        if m.state in (DROPPED, FINISHED):
            m.name = name
            self._set(m, LIVE)
            return True
        return False

    def record_push(self, rank: int, epoch: int, batch: int) -> None:
        m = self.members[rank]
        m.epoch, m.batch, m.pushes = epoch, batch, m.pushes + 1

    def finish(self, rank: int, name: str) -> None:
        self.seen(rank, name)
        self._set(self.members[rank], FINISHED)

    def drop(self, rank: int, name: str) -> bool:
        """Stop waiting for incarnation `name`; False when it is no longer rank's live one."""
        m = self.members.get(rank)
        if m is None or m.name != name or m.state != LIVE:
            return False
        self._set(m, DROPPED)
        return True

    def live(self) -> list[Member]:
        return [m for m in self.members.values() if m.state == LIVE]

    @property
    def all_finished(self) -> bool:
        return all(m.state == FINISHED for m in self.members.values())

    def missing(self) -> list[Member]:
        """Ranks that are neither live nor finished, and have been so for join_timeout."""
        now = self.clock()
        return [m for m in self.members.values() if m.state in (ABSENT, DROPPED) and now - m.since >= self.join_timeout]

    def done(self) -> bool:
        """Every rank finished, or nobody trains and every unfinished rank is past join_timeout."""
        if self.all_finished:
            return True
        unfinished = [m for m in self.members.values() if m.state != FINISHED]
        return not self.live() and len(self.missing()) == len(unfinished)

    def counts(self) -> str:
        live = len(self.live())
        finished = sum(m.state == FINISHED for m in self.members.values())
        return f"{live} live, {finished} finished of {len(self.members)}"

    def state(self) -> dict[int, dict[str, int]]:
        """Per-rank progress for a checkpoint."""
        return {r: {**m.progress(), "finished": int(m.state == FINISHED)} for r, m in self.members.items()}

    def restore(self, state: dict[int, dict[str, int]], same_run: bool = True) -> None:
        """Progress from a checkpoint; every rank must join again. A rank finished in it stays
        finished only when the checkpoint is of this run (`same_run`: a restarted PS, whose
        finished workers have exited and will not join again)."""
        for rank, p in state.items():
            if rank in self.members:
                m = self.members[rank]
                m.epoch, m.batch, m.pushes = p["epoch"], p["batch"], p["pushes"]
                if p.get("finished") and same_run:
                    self._set(m, FINISHED)

    def _set(self, m: Member, state: str) -> None:
        m.state, m.since = state, self.clock()
