"""How busy the host's cores were while a case ran: /proc/stat sampled in a thread, and the
share of all the host's cores busy over a window of the run (a case's steady state); and the
CPU the app's processes used in that window, per role (`python -m app ps` and `python -m app
worker`, their loader processes included, as processes or in containers on this host).

A row of the GPU regime measures the exchange only while the host has cores to spare: at a
share near 100% the case is bound by the bench host's CPU (and its memory bandwidth), which a
GPU host with more cores would not be. Linux only: elsewhere no sample is taken and the share
is None.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

PROC = Path("/proc")
PROC_STAT = PROC / "stat"
TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100  # jiffies a second
RECHECK_S = 1.0  # how long a process that is not the app's is taken not to be
ROLES = ("ps", "worker")  # `python -m app ROLE`: the processes counted per role
# (time.time(), busy jiffies, all jiffies) every core together, {"role:pid": jiffies} of each app process
Sample = tuple[float, int, int, dict[str, int]]


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
    busy0, all0, busy1, all1 = inside[0][1], inside[0][2], inside[-1][1], inside[-1][2]
    return (busy1 - busy0) / (all1 - all0) if all1 > all0 else None


def app_role(cmdline: bytes) -> str | None:
    """The role of a `python -m app ROLE ...` process from its /proc/PID/cmdline (NUL-separated
    arguments), else None."""
    args = cmdline.split(b"\0")
    for i in range(len(args) - 2):
        if args[i] == b"-m" and args[i + 1] == b"app":
            role = args[i + 2].decode(errors="replace")
            return role if role in ROLES else None
    return None


def process_jiffies(stat_text: str) -> int:
    """utime + stime from a /proc/PID/stat text (fields 14 and 15; the name in parentheses
    may hold spaces)."""
    fields = stat_text.rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def cpu_seconds(samples: list[Sample], start: float, end: float) -> dict[str, float]:
    """Per role, the CPU seconds its processes used from `start` to `end` (time.time()), read
    between the first sample at or after `start` and the last at or before `end`: each
    process's jiffies at the last sample that saw it less those at the first (0 for one that
    started inside); {} when fewer than two samples fall inside or no app process was seen."""
    inside = [s for s in samples if start <= s[0] <= end]
    if len(inside) < 2:
        return {}
    used: dict[str, float] = {}
    for key in dict.fromkeys(k for s in inside for k in s[3]):
        seen = [s[3][key] for s in inside if key in s[3]]
        role = key.split(":", 1)[0]
        used[role] = used.get(role, 0.0) + (seen[-1] - inside[0][3].get(key, 0)) / TICKS
    return used


class Sampler:
    """`with Sampler() as s:` samples /proc/stat every `every` seconds in a thread until the
    block ends; `s.samples` then holds them, the first taken on entry and the last on exit."""

    def __init__(self, every: float = 0.1) -> None:
        self.every = every
        self.samples: list[Sample] = []
        self._roles: dict[int, tuple[str | None, float]] = {}  # pid -> its app role (None: none), when read
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
        self.samples.append((time.time(), busy, all_, self._app_jiffies()))

    def _app_jiffies(self) -> dict[str, int]:
        """`role:pid` -> jiffies for every app process now. An app process's cmdline is read
        once; another's again after RECHECK_S (a container's process starts as the runtime's
        init and becomes python -m app by exec, under the same pid)."""
        out = {}
        now = time.monotonic()
        pids = [int(entry.name) for entry in PROC.iterdir() if entry.name.isdigit()]
        alive = set(pids)
        self._roles = {pid: known for pid, known in self._roles.items() if pid in alive}  # a gone pid may come back
        for pid in pids:
            entry = PROC / str(pid)
            try:
                role, read = self._roles.get(pid, (None, -RECHECK_S))
                if role is None and now - read >= RECHECK_S:
                    role = app_role((entry / "cmdline").read_bytes())
                    self._roles[pid] = (role, now)
                if role is not None:
                    out[f"{role}:{pid}"] = process_jiffies((entry / "stat").read_text())
            except (OSError, IndexError, ValueError):  # gone meanwhile
                continue
        return out
