"""How busy the host's cores were while a case ran: /proc/stat sampled in a thread, and the
share of all the host's cores busy over a window of the run (a case's steady state).

A row of the GPU regime measures the exchange only while the host has cores to spare: at a
share near 100% the case is bound by the bench host's CPU (and its memory bandwidth), which a
GPU host with more cores would not be. Linux only: elsewhere no sample is taken and the share
is None.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

PROC_STAT = Path("/proc/stat")
Sample = tuple[float, int, int]  # (time.time(), busy jiffies, all jiffies), every core together


def jiffies(stat_text: str) -> tuple[int, int]:
    """(busy, all) from /proc/stat's text: its `cpu` line, every core summed; busy is all but
    idle and iowait (user, nice, system, irq, softirq, steal; guest time is inside user)."""
    for line in stat_text.splitlines():
        fields = line.split()
        if fields and fields[0] == "cpu":
            values = [int(v) for v in fields[1:9]]
            idle = values[3] + values[4]
            return sum(values) - idle, sum(values)
    raise ValueError("no `cpu` line in /proc/stat")


def busy_share(samples: list[Sample], start: float, end: float) -> float | None:
    """The share (0-1) of all the host's cores busy from `start` to `end` (time.time()), read
    between the first sample at or after `start` and the last at or before `end`; None when
    fewer than two samples fall inside."""
    inside = [s for s in samples if start <= s[0] <= end]
    if len(inside) < 2:
        return None
    (_, busy0, all0), (_, busy1, all1) = inside[0], inside[-1]
    return (busy1 - busy0) / (all1 - all0) if all1 > all0 else None


class Sampler:
    """`with Sampler() as s:` samples /proc/stat every `every` seconds in a thread until the
    block ends; `s.samples` then holds them, the first taken on entry and the last on exit."""

    def __init__(self, every: float = 0.1) -> None:
        self.every = every
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-cpu-sampler", daemon=True)

    def __enter__(self) -> Sampler:
        if PROC_STAT.exists():
            self._take()
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._thread.is_alive():
            self._stop.set()
            self._thread.join()
            self._take()

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self._take()

    def _take(self) -> None:
        busy, all_ = jiffies(PROC_STAT.read_text())
        self.samples.append((time.time(), busy, all_))
