"""`scale`: grow or shrink a running cluster to N workers without stopping it, on the target's
blocks (orchestrator/backends/base.py `scale_to`); which cluster, as every cluster verb
finds it, is orchestrator/verbs/cluster.py's.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Optional, TextIO

from orchestrator import runs
from orchestrator.backends.base import Backend, Cluster, ServiceState
from orchestrator.errors import EngineError, UsageError, engine_errors
from orchestrator.hints import command
from orchestrator.metrics import records
from orchestrator.topology.model import Topology, load_with
from orchestrator.topology.services import PS_SERVICE, has_ps, worker_name
from orchestrator.verbs.cluster import keep_document, listed, resolve


def running_workers(states: Sequence[ServiceState]) -> Optional[dict[int, str]]:
    """{rank: service} of the running (or restarting) workers; None when the PS is not running."""
    active = [s for s in states if s.status in ("running", "restarting")]
    if not any(s.service == PS_SERVICE for s in active):
        return None
    return {s.spec.rank: s.service for s in active if s.spec is not None and s.spec.role == "worker"}


def scale_plan(running: dict[int, str], workers: int) -> tuple[list[str], list[str]]:
    """(services to start, services to stop) so that ranks 1..workers run: the missing ranks
    up to `workers` start, and the running ranks above it stop, highest first."""
    start = [worker_name(r) for r in range(1, workers + 1) if r not in running]
    stop = [running[r] for r in sorted(running, reverse=True) if r > workers]
    return start, stop


def scalable(c: Cluster, workers: int) -> Topology:
    """The topology of `c` if it can run `workers` workers (UsageError, one line, if not)."""
    t = c.topology
    if t is None:
        if not c.config:
            raise UsageError(f"scale: the topology of {c.name} is unknown; give it with -c CONFIG")
        t = load_with(c.config, workers=c.workers, strategy=c.strategy, overrides=c.overrides)
    if not has_ps(t):
        raise UsageError(
            f"scale: strategy allreduce has a fixed world size; stop it ({command('down')}) and start it again with "
            f"the new count from its last checkpoint: {command('up', WORKERS='N', RESUME=1)}"
        )
    if workers > t.max_workers:
        raise UsageError(
            f"--workers: {workers} is more than workers.max ({t.max_workers}) of {c.config}; raise workers.max "
            "there and start the cluster again (the render reserves a GPU and a service per possible worker)"
        )
    return t


@engine_errors
def scale(
    backend: Backend,
    config: Optional[str],
    workers: int,
    *,
    name: Optional[str] = None,
    out: Optional[TextIO] = None,
    files: Sequence[str] = (),
) -> int:
    """Grow or shrink the running cluster to `workers` workers without stopping it: the next
    ranks start (rendered up to workers.max); the highest ones get SIGTERM (each leaves the job
    cleanly and exits 0, so its restart policy leaves it stopped)."""
    out = out or sys.stdout
    backend.refuse("scale")
    c = resolve(backend, config, None, None, name, files)
    t = scalable(c, workers)
    states = listed(backend, c, backend.describe(c))
    running = running_workers(states)
    if running is None:
        raise UsageError(_not_running(backend, c, states))
    keep_document(backend, c)
    start, stop = scale_plan(running, workers)
    env = runs.start(backend.running_env(c, runs.VARIABLES), resume=False)[0] if start else {}
    if start and _wrote_its_end(backend, c, env.get(runs.RUN_ID, "")):  # ending: its PS has not exited yet
        raise UsageError(_ended_line(backend, c, "its PS wrote its end"))
    failed: Optional[EngineError] = None
    if start or stop:
        try:
            backend.scale_to(c, start, stop, env)
        except EngineError as e:
            failed = e
    if start:  # the run may have ended while the services started: say so, and leave none half-made
        if _ended_ps(backend.describe(c)) is not None:
            backend.discard_created(c, start)
            raise UsageError(_ended_line(backend, c))
    if failed is not None:
        raise failed
    change = "; ".join(
        part
        for part in (f"started {' '.join(start)}" if start else "", f"stopped {' '.join(stop)}" if stop else "")
        if part
    )
    print(
        f"==> scale: {backend.noun} {c.name} runs {workers} of at most {t.max_workers} workers"
        f" ({change or 'nothing to change'}). Next: {command(backend.verb('status'))}",
        file=out,
        flush=True,
    )
    return 0


def _ended_ps(states: Sequence[ServiceState]) -> Optional[ServiceState]:
    """The PS's state when the run has ended: it exited 0 (a failed one is restarted)."""
    return next((s for s in states if s.service == PS_SERVICE and s.ended and s.exit_code == 0), None)


def _wrote_its_end(backend: Backend, c: Cluster, run_id: str) -> bool:
    """Whether the PS's records of run `run_id` hold its end (`end`, or final.pt's `checkpoint`
    record): the run is over even while its PS is still on its way out."""
    if not run_id:
        return False
    try:
        lines = backend.read_records(c, PS_SERVICE).get(f"{PS_SERVICE}.jsonl", [])
    except EngineError:
        return False
    mine = False
    for record in records.parse_lines(lines):
        if record.get("event") == "start":
            mine = record.get("run_id") == run_id
        elif mine and (record.get("event") == "end" or record.get("file") == "final.pt"):
            return True
    return False


def _ended_line(backend: Backend, c: Cluster, how: str = "its PS exited 0") -> str:
    return (
        f"scale: the run of {backend.noun} {c.name} has ended ({how}): nothing to scale; "
        f"{command(backend.verb('status'))} shows how it ended, {command(backend.verb('up'))} starts a new run"
    )


def _not_running(backend: Backend, c: Cluster, states: Sequence[ServiceState]) -> str:
    if _ended_ps(states) is not None:
        return _ended_line(backend, c)
    return f"scale: the PS of {backend.noun} {c.name} is not running; start it with {command(backend.verb('up'))}"
