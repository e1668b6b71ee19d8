"""One run of a topology on any target, through that target's blocks alone
(orchestrator/backends/base.py): `deploy` starts it, `describe` says how each service fares,
`read_records` gives its records, `signal_app` strikes a service's app, `remove` ends it.

The one handle by which chaos's faults (orchestrator/chaos/faults.py: it is their `Job`), the
benches and the tests start a run and watch it, whether as local processes or as a compose
project.
"""

from __future__ import annotations

import io
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

from app.contract import Event
from orchestrator import runs
from orchestrator.backends.base import Backend, Cluster, ServiceState
from orchestrator.backends.registry import LOCAL
from orchestrator.metrics.records import Record, events, parse_lines
from orchestrator.render.yamlio import write_atomic
from orchestrator.topology.model import Topology
from orchestrator.topology.services import by_name, service_names

RUN_TIMEOUT = 300.0  # seconds a run may take to end, by default
POLL = 0.2


class Timeout(Exception):
    """What was waited for did not come in time (the message says what)."""


def wait_until(what: str, check: Callable[[], Any], timeout: float) -> Any:
    """Poll `check` until it returns something truthy; Timeout naming `what`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(POLL)
    raise Timeout(f"{what}: not within {timeout:.0f} s")


class TargetRun:
    """One run of topology `t` on `backend`, its document at `c.file`. `keep`: `close` leaves
    the run's state (checkpoints, metrics) where it is."""

    def __init__(self, backend: Backend, t: Topology, c: Cluster, keep: bool = False) -> None:
        self.backend, self.t, self.c, self.keep = backend, t, c, keep
        self._failed: dict[str, tuple[Optional[int], float]] = {}  # name -> (status, unix time first seen failing)
        c.file.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(c.file, backend.render(t, str(Path.cwd())))

    @classmethod
    def local(cls, t: Topology, runs_dir: Path) -> TargetRun:
        """`t` as local processes, its run's directory runs_dir/<name>/ (kept on close)."""
        return cls(LOCAL, t, Cluster(t.name, runs_dir / t.name / LOCAL.output, topology=t), keep=True)

    @property
    def run_dir(self) -> Path:
        return self.c.file.parent

    def up(self, resume: bool = False) -> None:
        """A new run (`resume`: one that continues the newest unfinished checkpoint), started
        once every service is."""
        self.backend.deploy(self.c, runs.environment(runs.new_id(), resume), io.StringIO())

    def down(self, volumes: bool) -> float:
        """End the run (`volumes`: its state too); the seconds it took."""
        start = time.monotonic()
        self.backend.remove(self.c, volumes=volumes)
        return time.monotonic() - start

    def close(self) -> None:
        self.down(volumes=not self.keep)

    def service_states(self) -> dict[str, ServiceState]:
        return {s.service: s for s in self.backend.describe(self.c)}

    def log(self, name: str) -> str:
        """The lines `name`'s app wrote, every start of it, without their prefix."""
        prefix = re.compile(rf"^{re.escape(name)}(-\d+)?\s*\| ?")
        lines = self.backend.log_iter(self.c, follow=False)
        try:
            return "".join(prefix.sub("", line) for line in lines if prefix.match(line))
        finally:
            lines.close()

    # The blocks of chaos.faults.Job.

    def events(self, name: str, event: Event, since: float = 0.0) -> list[Record]:
        """Records of `name` (`ps`, `worker2`) with this event, written after `since` (unix time)."""
        files = self.backend.read_records(self.c, name)
        known = by_name(self.t)  # a worker above workers.count (scaled up) writes <name>.jsonl too
        file = known[name].metrics_file if name in known else f"{name}.jsonl"
        return events(parse_lines(files.get(file, [])), event, since)

    def kill(self, name: str) -> float:
        """SIGKILL the app of `name`, as the OOM killer would; the unix time just before."""
        return self.backend.signal_app(self.c, name, "SIGKILL")

    def signal(self, name: str, signal_name: str) -> float:
        return self.backend.signal_app(self.c, name, signal_name)

    def restarts(self, name: str) -> int:
        found = self.service_states().get(name)
        return found.restarts if found else 0

    def failures(self, since: float) -> dict[str, tuple[Optional[int], float]]:
        """Each service seen failing (started again, about to be, or ended non-zero), first seen after `since`."""
        now = time.time()
        for name, s in self.service_states().items():
            failing = s.restarts >= 1 or s.status == "restarting" or (s.ended and s.exit_code)
            if name not in self._failed and failing:
                self._failed[name] = (s.exit_code or None, now)
        return {name: f for name, f in self._failed.items() if f[1] >= since}

    def ended(self, timeout: float = RUN_TIMEOUT) -> dict[str, int]:
        """Every service's exit status once each has ended for good (none to be started again)."""
        return {name: s.exit_code if s.exit_code is not None else -1 for name, s in self.wait_done(timeout).items()}

    def wait_done(self, timeout: float = RUN_TIMEOUT) -> dict[str, ServiceState]:
        """Every service ended and staying so; those started by a scale too."""
        expected = set(service_names(self.t))

        def done() -> Optional[dict[str, ServiceState]]:
            found = self.service_states()
            return found if expected <= set(found) and all(s.ended for s in found.values()) else None

        return wait_until("every service ended", done, timeout)
