"""Timing a worker's step loop: warm-up, a measured window, then a tail.

Every worker of a case measures the same wall-clock window length; the tail
keeps it working after its own window so that the other workers' windows
see the same contention (they start a little later or earlier).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

Step = Callable[[], tuple[float, float]]  # one step: (compute seconds, communication seconds)


def time_compute(compute: Callable[[], None], seconds: float | None, min_steps: int = 3) -> float | None:
    """Median seconds of `compute` alone, run for about `seconds` (at least min_steps times);
    None without running it when `seconds` is None (the headline has a compute-only case)."""
    if seconds is None:
        return None
    times: list[float] = []
    end = time.perf_counter() + seconds
    while len(times) < min_steps or time.perf_counter() < end:
        t0 = time.perf_counter()
        compute()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_steps(step: Step, warmup: int, steps: int, tail: float = 0.0) -> dict[str, Any]:
    """`steps` timed steps after `warmup` untimed ones: the steady state of a step.

    A fixed count keeps workers that wait for each other (sync, allreduce, the
    reference PS's rounds) in step to the end; `tail` seconds of further steps
    (only for workers that never wait for each other) keep the contention on
    while another worker finishes its count.
    """
    return _timed_steps(step, warmup, lambda done, _elapsed: done < steps, tail)


def run_window(step: Step, warmup: int, seconds: float, tail: float) -> dict[str, Any]:
    """Steps completed in a window of `seconds` after `warmup` steps; medians per step."""
    return _timed_steps(step, warmup, lambda _done, elapsed: elapsed < seconds, tail)


def _timed_steps(step: Step, warmup: int, more: Callable[[int, float], bool], tail: float) -> dict[str, Any]:
    """`warmup` untimed steps, then timed ones while `more(steps done, seconds elapsed)`,
    then untimed ones for `tail` seconds."""
    for _ in range(warmup):
        step()
    records: list[tuple[float, float, float]] = []
    start = time.perf_counter()
    while more(len(records), time.perf_counter() - start):
        t0 = time.perf_counter()
        compute, comm = step()
        records.append((compute, comm, time.perf_counter() - t0))
    window = time.perf_counter() - start
    end = time.perf_counter() + tail
    while time.perf_counter() < end:
        step()
    return _summary(records, window)


def _summary(records: list[tuple[float, float, float]], window: float) -> dict[str, Any]:
    """Steps and window length; medians of (compute, communication, whole step) seconds."""
    return {
        "steps": len(records),
        "window_s": window,
        "compute_s": statistics.median(r[0] for r in records),
        "comm_s": statistics.median(r[1] for r in records),
        "step_s": statistics.median(r[2] for r in records),
    }


def run(step: Step, p: dict[str, Any], lockstep: bool = False) -> dict[str, Any]:
    """The case's loop: a fixed count when `p` has "steps" (the headline table), else a
    window of p["seconds"] (the full matrix). `lockstep`: the workers wait for each
    other, so no tail (a step past the others' last would wait for ever)."""
    if p.get("steps"):
        return run_steps(step, p["warmup"], p["steps"], 0.0 if lockstep else p.get("tail", 0.0))
    return run_window(step, p["warmup"], p["seconds"], p["tail"])
