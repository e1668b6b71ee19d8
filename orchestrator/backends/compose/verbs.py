"""The container verbs: build, up, down, logs, status, smoke, scale.

Each verb is a function returning an exit status; the CLI only parses and
calls them. Docker is reached through `orchestrator.images` (SDK: builds) and
`adapter` (the compose command line, container reads); the parsing is in
`status` and the smoke run's judging in `orchestrator.backends.smoke`, pure
functions with unit tests.

Files: `up` renders the topology to runs/<project>/compose.yaml (compose.yaml at
the top stays the rendered default, kept in git) and records the project in
runs/current.json, so `logs`, `status` and `down` without `-c` act on the
cluster `up` started last.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, TextIO

import yaml

from orchestrator import images, runs
from orchestrator.backends import smoke as smoke_run
from orchestrator.backends.compose import adapter, doctor
from orchestrator.backends.compose.inspect import from_compose
from orchestrator.backends.compose.status import (
    container_state,
    format_live,
    format_status,
    live_workers,
    service_row,
    status_services,
)
from orchestrator.doctor.checks import run_checks
from orchestrator.doctor.facts import gather
from orchestrator.doctor.report import stop_on_problems, summary
from orchestrator.errors import UsageError, engine_errors
from orchestrator.host_paths import check_paths
from orchestrator.metrics.records import final_accuracy, parse_lines
from orchestrator.paths import DEFAULT_CONFIG, ROOT, RUNS, SMOKE_CONFIG, relative
from orchestrator.render import compose
from orchestrator.render.yamlio import write_atomic, write_if_changed
from orchestrator.topology.model import Topology, load_with
from orchestrator.topology.services import (
    LABEL_RANK,
    LABEL_ROLE,
    PS_SERVICE,
    Service,
    by_name,
    describe,
    has_ps,
    rendezvous_service,
    service_names,
    services,
    worker_service,
)

CURRENT = RUNS / "current.json"
CPU_HINT = f"CONFIG={SMOKE_CONFIG} runs anywhere: make up CONFIG={SMOKE_CONFIG} WORKERS=3"
# `scale` down: a worker's SIGTERM is a clean leave (its push answered, the PS told); compose
# kills it after this many seconds (its own SIGTERM grace is at most 5 s).
SCALE_STOP_SECONDS = 20


# --- which cluster --------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """A cluster to act on: its compose project, and its topology when known."""

    project: adapter.Project
    topology: Optional[Topology] = None
    config: Optional[str] = None


def compose_file(project: str) -> Path:
    return RUNS / project / "compose.yaml"


def target(
    config: Optional[str], workers: Optional[int], *, project: Optional[str] = None, strategy: Optional[str] = None
) -> Target:
    """The cluster named by `-c/--workers/--strategy`; with none, the one `up` started
    last (runs/current.json), else the default topology."""
    if config is None and workers is None and strategy is None and project is None and CURRENT.is_file():
        rec = json.loads(CURRENT.read_text(encoding="utf-8"))
        return Target(adapter.Project(rec["project"], rec["compose_file"], str(ROOT)), config=rec.get("config"))
    config = config or DEFAULT_CONFIG
    t = load_with(config, workers=workers, strategy=strategy)
    name = project or compose.project_name(t)
    return Target(adapter.Project(name, str(compose_file(name)), str(ROOT)), t, config)


def render_if_needed(t: Topology, path: Path) -> bool:
    """Write the compose file of `t` to `path` unless it already holds exactly that."""
    return write_if_changed(path, compose.dump(compose.render(t), t.name))


def preflight(t: Topology, config: str, client: Any, out: TextIO) -> None:
    """The doctor's checks for compose (backends/compose/doctor.py); stop before starting
    anything when one fails (UsageError: the first problem and its fix, one line)."""
    check_paths(t, config, ROOT)  # `code`, train.init_weights: relative to the repository, as compose mounts them
    checks = run_checks(doctor.CHECKS, t, gather(t, client=client, target=doctor.gather_facts))
    stop_on_problems(checks, config, CPU_HINT if t.cuda or t.reads_files else "")
    print(f"==> doctor: {summary(checks)} (python -m orchestrator doctor lists them)", file=out, flush=True)


# --- verbs ----------------------------------------------------------------


@engine_errors
def build(config: str, workers: Optional[int] = None, *, offline: bool = False, verbose: bool = False) -> int:
    t = target(config, workers).topology
    assert t is not None
    base, pip_source = images.source(t, offline)
    images.build(t.image_tag, base, pip_source, verbose=verbose)
    return 0


@engine_errors
def up(
    config: str,
    workers: Optional[int] = None,
    *,
    offline: bool = False,
    project: Optional[str] = None,
    remember: bool = True,
    out: TextIO = sys.stdout,
    strategy: Optional[str] = None,
    resume: bool = False,
) -> int:
    """A new run (orchestrator.runs: its own id; `resume`: the PS continues the newest
    unfinished checkpoint), or, while the project's run goes on, that run unchanged."""
    tg = target(config, workers, project=project, strategy=strategy)
    t = tg.topology
    assert t is not None
    client = images.client()
    preflight(t, config, client, out)
    found = adapter.detect()
    path = Path(tg.project.file)
    wrote = render_if_needed(t, path)
    print(
        f"==> {'rendered' if wrote else 'up to date:'} {relative(path)}: {describe(t)}, project {tg.project.name}",
        file=out,
        flush=True,
    )
    if images.image_exists(client, t.image_tag):
        print(f"==> image {t.image_tag} present (make build rebuilds it)", file=out, flush=True)
    else:
        base, pip_source = images.source(t, offline)
        images.build(t.image_tag, base, pip_source, out=out)
    env, line = runs.start(adapter.running_env(client, tg.project.name, runs.VARIABLES), resume)
    print(f"==> {line}", file=out, flush=True)
    print(f"==> starting with {found}", file=out, flush=True)
    adapter.run(adapter.up_argv(found, tg.project), env=env)
    if remember:
        _remember(tg)
    print(f"==> up: project {tg.project.name}. Next: make logs | make status | make down", file=out, flush=True)
    return 0


@engine_errors
def down(
    config: Optional[str] = None,
    workers: Optional[int] = None,
    *,
    volumes: bool = False,
    project: Optional[str] = None,
    strategy: Optional[str] = None,
) -> int:
    tg = target(config, workers, project=project, strategy=strategy)
    images.client()
    if tg.topology is not None:
        render_if_needed(tg.topology, Path(tg.project.file))
    adapter.run(adapter.down_argv(adapter.detect(), tg.project, volumes=volumes))
    kept = (
        "volume removed"
        if volumes
        else f"checkpoints and metrics kept in volume {tg.project.name}_{compose.STATE_VOLUME}"
    )
    print(f"==> down: project {tg.project.name} stopped and removed; {kept}")
    return 0


@engine_errors
def logs(
    config: Optional[str] = None,
    workers: Optional[int] = None,
    *,
    follow: bool = True,
    project: Optional[str] = None,
    strategy: Optional[str] = None,
) -> int:
    tg = target(config, workers, project=project, strategy=strategy)
    images.client()
    if tg.topology is not None:
        render_if_needed(tg.topology, Path(tg.project.file))
    argv = adapter.logs_argv(adapter.detect(), tg.project, follow=follow, color=sys.stdout.isatty())
    return adapter.run(argv, check=False).returncode


@engine_errors
def status(
    config: Optional[str] = None,
    workers: Optional[int] = None,
    *,
    project: Optional[str] = None,
    out: TextIO = sys.stdout,
    strategy: Optional[str] = None,
) -> int:
    tg = target(config, workers, project=project, strategy=strategy)
    client = images.client()
    found = adapter.containers(client, tg.project.name)
    listed = status_services(_configured(tg), [c.attrs for c in found])
    metrics = adapter.read_metrics(client, tg.project.name, found)
    rows = [service_row(s.name, attrs, metrics.get(s.metrics_file, [])) for s, attrs in listed]
    print(f"project {tg.project.name} ({relative(Path(tg.project.file))})", file=out)
    for line in format_status(rows):
        print(line, file=out)
    if PS_SERVICE in {s.name for s, _ in listed}:
        print(format_live(live_workers(metrics.get(f"{PS_SERVICE}.jsonl", []))), file=out)
    return 0


def running_workers(client: Any, project: str) -> Optional[dict[int, str]]:
    """{rank: service} of the project's running (or restarting) workers; None when its PS is not running."""
    running: dict[int, str] = {}
    ps = False
    for c in adapter.containers(client, project):
        state = container_state(c.attrs)
        labels = (c.attrs.get("Config") or {}).get("Labels") or {}
        if state["status"] not in ("running", "restarting"):
            continue
        if state["service"] == PS_SERVICE:
            ps = True
        elif labels.get(LABEL_ROLE) == "worker" and str(labels.get(LABEL_RANK, "")).isdigit():
            running[int(labels[LABEL_RANK])] = state["service"]
    return running if ps else None


def scale_plan(running: dict[int, str], workers: int) -> tuple[list[str], list[str]]:
    """(services to start, services to stop) so that ranks 1..workers run: the missing ranks
    up to `workers` start, and the running ranks above it stop, highest first."""
    start = [worker_service(r) for r in range(1, workers + 1) if r not in running]
    stop = [running[r] for r in sorted(running, reverse=True) if r > workers]
    return start, stop


@engine_errors
def scale(config: Optional[str], workers: int, *, project: Optional[str] = None, out: TextIO = sys.stdout) -> int:
    """Grow or shrink the running cluster to `workers` workers without stopping it: up starts
    the next ranks (rendered up to workers.max), down sends the highest ranks SIGTERM (each
    leaves the job cleanly and exits 0, so its restart policy leaves it stopped)."""
    tg = target(config, None, project=project)
    t = tg.topology
    if t is None:
        if not tg.config:
            raise UsageError(f"scale: the topology of project {tg.project.name} is unknown; give it with -c CONFIG")
        t = load_with(tg.config)
    if not has_ps(t):
        raise UsageError(
            "scale: strategy allreduce has a fixed world size; stop it (make down) and start it again with "
            "the new count from its last checkpoint: make up WORKERS=N RESUME=1"
        )
    if workers > t.max_workers:
        raise UsageError(
            f"--workers: {workers} is more than workers.max ({t.max_workers}) of {tg.config}; raise workers.max "
            "there and start the cluster again (the render reserves a GPU and a service per possible worker)"
        )
    client = images.client()
    running = running_workers(client, tg.project.name)
    if running is None:
        raise UsageError(f"scale: the PS of project {tg.project.name} is not running; start it with make up")
    if tg.topology is not None:
        render_if_needed(t, Path(tg.project.file))
    found = adapter.detect()
    start, stop = scale_plan(running, workers)
    if start:
        env, _ = runs.start(adapter.running_env(client, tg.project.name, runs.VARIABLES), resume=False)
        adapter.run(adapter.start_services_argv(found, tg.project, start), env=env)
    if stop:
        adapter.run(adapter.stop_argv(found, tg.project, stop, SCALE_STOP_SECONDS))
    change = "; ".join(
        part
        for part in (f"started {' '.join(start)}" if start else "", f"stopped {' '.join(stop)}" if stop else "")
        if part
    )
    print(
        f"==> scale: project {tg.project.name} runs {workers} of at most {t.max_workers} workers"
        f" ({change or 'nothing to change'}). Next: make status",
        file=out,
        flush=True,
    )
    return 0


@engine_errors
def smoke(
    config: str = SMOKE_CONFIG,
    workers: int = 2,
    *,
    timeout: float = 900,
    threshold: float = 0.90,
    project: Optional[str] = None,
    out: TextIO = sys.stdout,
    strategy: Optional[str] = None,
) -> int:
    """The CPU cluster end to end in real containers: offline image, up, wait for
    every container to exit, check rank 0's accuracy (the PS's `end` record, or
    worker1's for allreduce) and every exit status, print every log on failure, always tear
    down (volume included)."""
    timings = smoke_run.Timings("smoke")
    t = load_with(config, workers=workers, strategy=strategy)
    name = project or f"{compose.project_name(t)}-smoke"
    client = images.client()
    found = adapter.detect()
    tmp = Path(tempfile.mkdtemp(prefix="ps-compose-smoke-"))
    proj = adapter.Project(name, str(tmp / "compose.yaml"), str(ROOT))
    try:
        write_atomic(proj.file, compose.dump(compose.render(t), t.name))
        base, pip_source = images.source(t, offline=True)
        with timings.step("image"):
            images.build(t.image_tag, base, pip_source, out=out)
        adapter.run(adapter.down_argv(found, proj, volumes=True), capture=True, check=False)  # a former run's leftovers
        print(f"==> smoke: project {name}, {describe(t)}, with {found}", file=out, flush=True)
        expected = service_names(t)
        with timings.step("run"):
            adapter.run(adapter.up_argv(found, proj), env=runs.environment(runs.new_id(), False))
            finished = adapter.wait_exited(client, name, len(expected), timeout, out)
        found_containers = adapter.containers(client, name)
        states = [container_state(c.attrs) for c in found_containers]
        rank0 = rendezvous_service(t)
        files = adapter.read_metrics(client, name, found_containers)
        accuracy = final_accuracy(parse_lines(files.get(by_name(t)[rank0].metrics_file, [])))
        problems = smoke_run.judge(
            expected, states, accuracy, threshold, who="the PS" if rank0 == PS_SERVICE else rank0
        )
        if finished is None:
            problems.insert(0, f"not every container exited within {timeout:.0f} s")
        if problems:
            adapter.print_logs(client, name, out)
            for p in problems:
                print(f"smoke: FAILED: {p}", file=out)
            return 1
        print(
            f"smoke: passed: Accuracy {accuracy:.4f} >= {threshold:.2f}; "
            f"{len(expected)} containers exited 0 ({', '.join(expected)})",
            file=out,
        )
        return 0
    finally:
        with timings.step("down"):
            adapter.run(adapter.down_argv(found, proj, volumes=True), capture=True, check=False)
        shutil.rmtree(tmp, ignore_errors=True)
        print(timings.line(), file=out, flush=True)


# --- reads ----------------------------------------------------------------


def _configured(tg: Target) -> list[Service]:
    """The services the cluster is configured with: the topology's, else those of the
    compose file `up` rendered (none when it cannot be read)."""
    if tg.topology is not None:
        return services(tg.topology)
    try:
        doc = yaml.safe_load(Path(tg.project.file).read_text(encoding="utf-8"))
        return from_compose(doc)
    except (OSError, yaml.YAMLError, AttributeError, TypeError, ValueError):
        return []


def _remember(tg: Target) -> None:
    RUNS.mkdir(parents=True, exist_ok=True)
    rec = {"project": tg.project.name, "compose_file": tg.project.file, "config": tg.config}
    write_atomic(CURRENT, json.dumps(rec, indent=2) + "\n")
