"""The smoke verb, once for every target: the CPU topology end to end on the target (offline
image, deploy, wait for every service to end, judge every service's end and rank 0's
accuracy, print every log on failure, always remove the cluster and its volume)."""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path
from typing import Optional, TextIO

from orchestrator import images, runs
from orchestrator.backends import smoke as parts
from orchestrator.backends.base import Backend, Cluster, ServiceState
from orchestrator.backends.status import format_states
from orchestrator.errors import engine_errors
from orchestrator.metrics.records import course, final_accuracy, parse_lines
from orchestrator.paths import SMOKE_CONFIG
from orchestrator.render.yamlio import write_atomic
from orchestrator.topology.model import Topology, load_with
from orchestrator.topology.services import PS_SERVICE, by_name, describe, rendezvous_service, service_names
from orchestrator.verbs.cluster import refuse_live

RESTARTS = 3  # a service restarted this often is in a loop: the wait ends


def finished(expected: list[str]):
    """When the wait ends: every expected service and every other one found has ended, or
    one restarts again and again."""

    def done(states: list[ServiceState]) -> bool:
        found = {s.service for s in states}
        ended = set(expected) <= found and all(s.ended for s in states)
        return ended or any(s.restarts >= RESTARTS for s in states)

    return done


def _judge(
    backend: Backend, c: Cluster, t: Topology, states: Optional[list[ServiceState]], threshold: float, timeout: float
) -> tuple[list[str], Optional[float]]:
    expected = service_names(t)
    final = states if states is not None else backend.describe(c)
    rank0 = rendezvous_service(t)
    lines = backend.read_records(c, rank0).get(by_name(t)[rank0].metrics_file, [])
    records = parse_lines(lines)
    accuracy = final_accuracy(records)
    who = "the PS" if rank0 == PS_SERVICE else rank0
    problems = parts.judge(expected, final, accuracy, threshold, who=who, unit=backend.unit, course=course(records))
    if states is None:
        problems.insert(0, f"not every {backend.unit} ended within {timeout:.0f} s")
    return problems, accuracy


@engine_errors
def smoke(
    backend: Backend,
    config: str = SMOKE_CONFIG,
    workers: int = 2,
    *,
    strategy: Optional[str] = None,
    timeout: Optional[float] = None,
    threshold: float = 0.90,
    name: Optional[str] = None,
    out: Optional[TextIO] = None,
) -> int:
    out = out or sys.stdout
    backend.refuse("smoke")
    verb = f"{backend.verb_prefix}smoke"
    timeout = timeout or backend.smoke_timeout
    timings = parts.Timings(verb)
    t = load_with(config, workers=workers, strategy=strategy, name=name)
    name = name or f"{backend.name_of(t)}-{verb}"
    # Before anything is removed: a live run of the name (another smoke's) is not this one's.
    refuse_live(backend, Cluster(name, backend.path_of(name)), "smoke")
    tmp = Path(tempfile.mkdtemp(prefix=f"ps-compose-{verb}-"))
    c = Cluster(name, tmp / backend.output, config, workers, strategy, t)
    try:
        write_atomic(c.file, backend.document(t))
        if backend.engine:
            base, pip_source = images.source(t, offline=True)
            with timings.step("image"):
                images.build(t.image_tag, base, pip_source, out=out)
        backend.remove(c, volumes=True)  # a former run's leftovers
        print(f"==> {verb}: {backend.noun} {name}, {describe(t)}", file=out, flush=True)
        with timings.step("run"):
            ignored = backend.deploy(c, runs.environment(runs.new_id(), False), out)
            states = parts.wait(lambda: backend.describe(c), finished(service_names(t)), timeout, out, settle=True)
        problems, accuracy = _judge(backend, c, t, states, threshold, timeout)
        problems += ignored
        return _verdict(backend, c, t, verb, problems, accuracy, threshold, out)
    finally:
        with timings.step("down"):
            backend.remove(c, volumes=True)
        shutil.rmtree(tmp, ignore_errors=True)
        print(timings.line(), file=out, flush=True)


def _verdict(
    backend: Backend,
    c: Cluster,
    t: Topology,
    verb: str,
    problems: list[str],
    accuracy: Optional[float],
    threshold: float,
    out: TextIO,
) -> int:
    expected = service_names(t)
    if backend.task_table:
        for line in format_states([s for s in backend.describe(c) if s.service in expected]):
            print(f"    {line}", file=out)
    if problems:
        lines = backend.log_iter(c, follow=False)
        for line in lines:
            out.write(line)
        lines.close()
        for p in problems:
            print(f"{verb}: FAILED: {p}", file=out)
        out.flush()
        return 1
    print(
        f"{verb}: passed: Accuracy {accuracy:.4f} >= {threshold:.2f}; {len(expected)} {backend.unit}s "
        f"{backend.ended_well} ({', '.join(expected)})",
        file=out,
        flush=True,
    )
    return 0
