"""The PS's side of membership: joins (one process per rank), pings, drops.

A worker calls the PS all the time (pull, push); one that has been quiet for
QUIET_SECONDS is pinged. A killed worker's ping fails at once (its
connection is gone), a frozen one's at the RPC timeout: either way it is
dropped, with one log line naming it, and the PS stops waiting for it. A
new process of the same rank may then join and resume the rank's progress;
while the old process still answers, the rank is taken and the newcomer is
refused.

Under ssp and sync one stuck worker holds up every other, and a process can
answer pings yet never push (a dead DataLoader child, a stuck collective):
one with no call for FROZEN_PERIODS x rpc_timeout, and no push waiting for an
answer, is reported (a log line and a `frozen` metrics record) and dropped.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from app.config import Config, UsageError
from app.contract import worker_name
from app.exchange import group, transport
from app.exchange.wire import Joined, Taken
from app.ps.server import ParameterServer
from app.runtime.words import first_line

log = logging.getLogger("app.ps")
QUIET_SECONDS = 1.0
TAKEN_PING_SECONDS = 5.0

Event = Callable[..., None]  # (event, **fields): a metrics line


class Pinger:
    """Pings by RPC name without waiting, at most one in flight per name."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._pinging: set[str] = set()
        self._lock = threading.Lock()

    def ping(self, name: str, lost: Callable[[str], None]) -> None:
        """Ping `name` (unless a ping of it is in flight); `lost(why)` when it fails."""
        with self._lock:
            if name in self._pinging:
                return
            self._pinging.add(name)
        future = transport.call_async(name, group.pong, timeout=self.timeout)
        future.add_done_callback(lambda f: self._answered(name, f, lost))

    def _answered(self, name: str, future: Any, lost: Callable[[str], None]) -> None:
        try:
            future.wait()
        except Exception as error:  # noqa: BLE001 - any failure: the process is gone or stuck
            lost(first_line(error))
        finally:
            with self._lock:
                self._pinging.discard(name)


class LivenessMonitor:
    """Admits workers (one live process per rank), pings quiet ones and drops the dead and the frozen."""

    FROZEN_PERIODS = 3  # rpc_timeout periods without a push before ssp/sync drop a live worker

    def __init__(
        self,
        server: ParameterServer,
        rpc_timeout: float,
        record: Event,
        on_drop: Callable[[int, str], None] | None = None,
        config: Config | None = None,
    ) -> None:
        self.server, self.rpc_timeout, self.record = server, rpc_timeout, record
        # The job whose store holds the notes of processes that end before they join
        # (app.exchange.group.say_not_joining); None: nobody is asked.
        self.config = config
        self._store: Any = None
        self._pinger = Pinger(rpc_timeout)
        self._last_tick = 0.0
        server.on_back = self.back
        server.on_leave = self.left
        # Called after a drop: a sharded PS forwards it to its other shards (app.ps.sharding.shardset).
        self.on_drop: Callable[[int, str], None] = on_drop or (lambda rank, name: None)

    def join(self, rank: int, name: str) -> Joined | Taken:
        """Admit `name` as rank's process, or say the rank is taken."""
        old = self.server.live_name(rank)
        if old and old != name:
            error = self._ping(old, min(self.rpc_timeout, TAKEN_PING_SECONDS))
            if error is None:
                return Taken(
                    f"rank {rank} is already taken by {old}, which is running "
                    f"(start each rank once; this process is {name})"
                )
            self.drop(rank, old, f"replaced by {name} ({error})")
        joined = self.server.join(rank, name)
        progress = joined.progress
        where = (
            "from the start"
            if progress.epoch == 1 and progress.batch == 0
            else f"at epoch {progress.epoch} after batch {progress.batch}"
        )
        log.info("%s (rank %d) joined at version %d, resuming %s", name, rank, joined.version, where)
        live = self.server.live_count()
        self.record("join", joined.version, worker=name, worker_rank=rank, workers=live, **progress._asdict())
        return joined

    def drop(self, rank: int, name: str, reason: str) -> None:
        if self.server.drop(rank, name):
            log.warning(
                "dropped %s (rank %d): %s; training goes on without it (%s)", name, rank, reason, self.server.summary()
            )
            live = self.server.live_count()
            self.record("drop", self.server.version, worker=name, worker_rank=rank, reason=reason, workers=live)
            self.on_drop(rank, name)

    def back(self, rank: int, name: str) -> None:
        log.warning(
            "%s (rank %d) is back: it called again after it was dropped (%s)", name, rank, self.server.summary()
        )
        self.record("back", self.server.version, worker=name, worker_rank=rank, workers=self.server.live_count())

    def left(self, rank: int, name: str) -> None:
        """A worker scaled down left the job: a `left` record (not a drop: nothing failed)."""
        self.record("left", self.server.version, worker=name, worker_rank=rank, workers=self.server.live_count())

    def tick(self) -> None:
        """Ping quiet workers; drop frozen ones and the ranks that said they will not join."""
        now = time.monotonic()
        if now - self._last_tick < QUIET_SECONDS / 2:
            return
        self._last_tick = now
        for rank, name, last_seen in self.server.live_members():
            if now - last_seen >= QUIET_SECONDS:
                self._ping_async(rank, name)
        self.check_frozen()
        self._not_joining()

    def _not_joining(self) -> None:
        """Stop waiting for the ranks whose process said it ended cleanly before it joined (a
        `left` record, as for a leave); the notes of ranks that joined again since are dropped."""
        if self.config is None:
            return
        if self._store is None:
            self._store = transport.own_store(self.config, self.rpc_timeout)
        said = group.mistake(self._store)
        if said:  # the workers' data and this PS's disagree: no worker can train, the run stops once
            raise UsageError(f"{said} (found by a worker as it joined)")
        for rank in group.not_joining(self._store, list(range(1, self.server.members.roster.max_rank + 1))):
            if self.server.drop(rank, None):
                log.info("rank %d left before it joined: its process ended cleanly (%s)", rank, self.server.summary())
                name, workers = worker_name(rank), self.server.live_count()
                self.record("left", self.server.version, worker=name, worker_rank=rank, workers=workers, joined=False)

    def check_frozen(self) -> None:
        """ssp/sync: report and drop live workers that stopped pushing (they answer pings)."""
        limit = self.FROZEN_PERIODS * self.rpc_timeout
        for rank, name, quiet in self.server.frozen(limit):
            log.warning(
                "%s (rank %d) answers pings but sent no push for %.0f s (%d x --rpc_timeout)",
                name,
                rank,
                quiet,
                self.FROZEN_PERIODS,
            )
            self.record("frozen", self.server.version, worker=name, worker_rank=rank, seconds=round(quiet, 1))
            self.drop(rank, name, f"no push for {quiet:.0f} s")

    def _ping_async(self, rank: int, name: str) -> None:
        self._pinger.ping(name, lambda why: self.drop(rank, name, f"no answer to a ping ({why})"))

    def _ping(self, name: str, timeout: float) -> str | None:
        """None when `name` answers within `timeout`, else why not."""
        try:
            transport.call(name, group.pong, timeout=timeout)
            return None
        except Exception as error:  # noqa: BLE001
            return first_line(error)
