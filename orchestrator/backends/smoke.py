"""The parts of the smoke verb (orchestrator/verbs/cluster.py): waiting for a cluster to
finish, timing its steps, and judging its end (pure: `judge`; the accuracy is rank 0's
`end` record, orchestrator.metrics.records.final_accuracy), on `ServiceState`s."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Optional, TextIO

from orchestrator.backends.base import ServiceState

State = ServiceState
REPORT_EVERY = 15.0  # seconds between two progress lines while waiting


def wait(
    read: Callable[[], list[State]],
    done: Callable[[list[State]], bool],
    timeout: float,
    out: TextIO,
    *,
    every: float = 2.0,
    settle: bool = False,
) -> Optional[list[State]]:
    """Poll `read` until `done` holds (on two polls in a row with `settle`: a failed swarm
    task's retry appears a moment later); the states, or None at the timeout. A progress
    line (each service's status) every REPORT_EVERY seconds."""
    start = last_report = time.monotonic()
    done_before = False
    while time.monotonic() - start < timeout:
        states = read()
        now_done = done(states)
        if now_done and (done_before or not settle):
            return states
        done_before = now_done
        if time.monotonic() - last_report >= REPORT_EVERY:
            last_report = time.monotonic()
            summary = ", ".join(f"{s.service} {s.task or s.status}" for s in sorted(states, key=lambda s: s.service))
            print(f"    {time.monotonic() - start:4.0f} s: {summary}", file=out, flush=True)
        time.sleep(every)
    return None


class Timings:
    """Seconds per step of a smoke run, printed as one line at the end."""

    def __init__(self, verb: str) -> None:
        self.verb, self.start = verb, time.monotonic()
        self.steps: dict[str, float] = {}

    @contextmanager
    def step(self, name: str) -> Iterator[None]:
        start = time.monotonic()
        try:
            yield
        finally:
            self.steps[name] = time.monotonic() - start

    def line(self) -> str:
        steps = ", ".join(f"{k} {v:.0f} s" for k, v in self.steps.items())
        return f"{self.verb}: {steps}; total {time.monotonic() - self.start:.0f} s"


def judge(
    expected: list[str],
    states: list[State],
    accuracy: Optional[float],
    threshold: float,
    who: str = "the PS",
    unit: str = "container",
    course: str = "",
) -> list[str]:
    """What went wrong in a smoke run (empty: it passed); `who` printed the accuracy, and
    `course` (orchestrator.metrics.records.course) says how the run got to it."""
    problems: list[str] = []
    by_service = {s.service: s for s in states}
    for service in expected:
        s = by_service.get(service)
        if s is None:
            problems.append(f"{service}: no {unit}")
        elif not s.ended:
            problems.append(f"{service}: still {s.status}")
        elif s.exit_code != 0:
            problems.append(f"{service}: exit status {s.exit_code}")
        elif s.restarts:
            problems.append(f"{service}: restarted {s.restarts} time(s)")
    if accuracy is None:
        problems.append(f"{who} wrote no `end` record with its accuracy")
    elif accuracy < threshold:
        problems.append(f"{who}'s Accuracy {accuracy:.4f} < {threshold:.2f}" + (f" ({course})" if course else ""))
    return problems
