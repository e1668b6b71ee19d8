"""What a PS process reads of its server (app.ps.server) while it serves: who is live, its
progress, its counts. Each read takes the server's lock and changes nothing."""

from __future__ import annotations

import threading
from typing import Any

from app.ps.counts import PushCounts
from app.ps.members.members import Members
from app.ps.policies.base import Policy
from app.ps.state import State


class Readings:
    """The server's read-only views (ParameterServer is one): its parts, under its lock."""

    _lock: threading.Lock
    state: State
    members: Members
    counts: PushCounts
    policy: Policy
    waits: bool  # the strategy holds answers (ssp, sync)
    rounds: bool  # the strategy steps in rounds (sync)

    def frozen(self, limit: float) -> list[tuple[int, str, float]]:
        """ssp/sync: (rank, name, seconds quiet) of live ranks that have not called for
        `limit` seconds and are not waiting for an answer to a push (async waits for no one)."""
        if not self.waits:
            return []
        with self._lock:
            return self.members.frozen(limit, self.policy.waiting)

    def live_name(self, rank: int) -> str | None:
        """The RPC name of rank's live process, if one is live."""
        with self._lock:
            return self.members.live_name(rank)

    def live_members(self) -> list[tuple[int, str, float]]:
        """(rank, name, last call time) of every live process."""
        with self._lock:
            return self.members.live()

    def live_count(self) -> int:
        """How many workers train now."""
        with self._lock:
            return self.members.live_count()

    def summary(self) -> str:
        """Who is live, finished and left, in a few words."""
        with self._lock:
            return self.members.summary()

    def progress(self) -> tuple[int, int, int, int, int]:
        """(version, samples, pushes applied, their staleness summed, live workers), read at once."""
        with self._lock:
            c = self.counts
            return self.state.version, c.samples, c.applied, c.staleness_sum, self.members.live_count()

    def total_updates(self) -> int | None:
        """The version this PS process will reach at the end, as the ranks' last pushes plan it
        now (app.ps.members.members.Members.updates_left); None when it cannot be known."""
        with self._lock:
            left = self.members.updates_left(self.rounds)
            return None if left is None else self.state.version + left

    def training_seconds(self) -> float | None:
        """From every rank joined (or, if one never did, the first join) to the last update."""
        with self._lock:
            return self.members.training_seconds(self.state.last_applied)

    @property
    def all_finished(self) -> bool:
        with self._lock:
            return self.members.all_finished

    def done(self) -> bool:
        """Every rank finished, or no one trains and the missing ones are past join_timeout."""
        with self._lock:
            return self.members.done()

    def stats(self) -> dict[str, Any]:
        """The `end` record's counts (app.ps.counts)."""
        with self._lock:
            return self.counts.fields(self.members.pushes)
