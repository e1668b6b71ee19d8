"""The user-facing verbs, written once on top of a target's blocks (orchestrator/backends/base.py):
up, down, logs, status; build (orchestrator/verbs/building.py); scale (orchestrator/verbs/scaling.py), smoke
(orchestrator/verbs/smoke.py) and tensorboard (orchestrator/verbs/board.py).

Each verb takes the target (`Backend`) and returns an exit status; the CLI only parses and
calls them. `up` renders the topology to runs/<name>/<the target's file> (compose.yaml at the
top stays the rendered default, kept in git) and records the cluster (orchestrator/backends/
record.py), so the other verbs without -c act on the cluster `up` started last.
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional, TextIO

import yaml

from orchestrator import images, run_lock, runs, user_packages
from orchestrator.backends import record
from orchestrator.backends.base import EVERY_LINE, Backend, Cluster, LogLines, LogOptions, ServiceState
from orchestrator.backends.inspect import from_compose
from orchestrator.backends.status import (
    format_live,
    format_progress,
    format_states,
    format_status,
    latest_progress,
    live_workers,
    service_row,
    state_row,
    status_document,
)
from orchestrator.doctor.checks import run_checks
from orchestrator.doctor.facts import Facts, gather
from orchestrator.doctor.report import stop_on_problems, summary
from orchestrator.errors import UsageError, engine_errors
from orchestrator.hints import command, via_make
from orchestrator.host_paths import check_paths
from orchestrator.paths import DEFAULT_CONFIG, ROOT, SMOKE_CONFIG, relative
from orchestrator.render import tracking
from orchestrator.render.compose import STATE_VOLUME
from orchestrator.render.yamlio import write_if_changed
from orchestrator.topology.model import Topology, load_with
from orchestrator.topology.services import PS_SERVICE, Service, describe, services, sort_key
from orchestrator.verbs import live_names
from orchestrator.verbs.building import ensure_image

POLL = 2.0  # seconds between two looks at the cluster while following its logs


# --- which cluster --------------------------------------------------------


def resolve(
    backend: Backend,
    config: Optional[str],
    workers: Optional[int],
    strategy: Optional[str] = None,
    name: Optional[str] = None,
    files: Sequence[str] = (),
) -> Cluster:
    """The cluster named by `-c/--workers/--strategy` (and `--name`, the topology's name
    overridden); `--name` alone: the last up of that name (runs/<name>/), else that cluster as
    its rendered file says; with none, the one the target's up started last, else the default
    topology's. Its override files (`-f`): `files` when given, else those its up recorded."""
    given = override_files(files)
    if config is None and workers is None and strategy is None:
        last = record.load(backend, name=name)
        if last is not None:
            return with_files(backend, last, given)
        if name is not None:
            path = backend.path_of(name)
            if not path.exists():
                raise UsageError(
                    f"no {backend.noun} named {name!r} here: {relative(path)} does not exist "
                    f"(`ps-compose runs` lists the runs; `ps-compose {backend.verb_prefix}up --name {name}` starts one)"
                )
            return with_files(backend, Cluster(name, path), given)
    config = config or DEFAULT_CONFIG
    t = load_with(config, workers=workers, strategy=strategy, name=name)
    found = backend.name_of(t)
    kept = record.load(backend, name=found)
    c = Cluster(found, backend.path_of(found), config, workers, strategy, t, files=kept.files if kept else ())
    return with_files(backend, c, given)


def override_files(files: Sequence[str]) -> tuple[Path, ...]:
    """`-f FILE`s as absolute paths (the record keeps them, and later verbs run from anywhere);
    UsageError naming one that is not a file."""
    for f in files:
        if not Path(f).is_file():
            raise UsageError(f"-f: {f}: no such file (a compose file to merge over the rendered one)")
    return tuple(Path(f).absolute() for f in files)


def with_files(backend: Backend, c: Cluster, given: tuple[Path, ...]) -> Cluster:
    """`c` with the override files `given` (checked by its target), else with those its up
    recorded that still exist (one warning names any gone since: down and logs still work)."""
    if given:
        c = replace(c, files=given)
        if c.file.exists():
            backend.check_files(c)
        return c
    gone = [f for f in c.files if not f.is_file()]
    if gone:
        print(
            f"warning: {', '.join(map(str, gone))}: gone since {c.name}'s up merged it; acting without it",
            file=sys.stderr,
        )
    return replace(c, files=tuple(f for f in c.files if f not in gone))


def configured(c: Cluster) -> list[Service]:
    """The services the cluster is configured with: the topology's, else those of the document
    up rendered (compose and stack files alike; none when it cannot be read)."""
    if c.topology is not None:
        return services(c.topology)
    try:
        return from_compose(yaml.safe_load(Path(c.file).read_text(encoding="utf-8")))
    except (OSError, yaml.YAMLError, AttributeError, TypeError, ValueError):
        return []


def listed(backend: Backend, c: Cluster, states: Sequence[ServiceState]) -> list[ServiceState]:
    """What status lists: every service found that is one of the job's (its spec known, from
    the target or the configuration), and every configured service not found; in rank order."""
    known = {s.name: s for s in configured(c)}
    found = [s.with_spec(known.get(s.service)) for s in states]
    out = [s for s in found if s.spec is not None]
    names = {s.service for s in out}
    out += [ServiceState(s.name, backend.missing, spec=s) for s in known.values() if s.name not in names]
    return sorted(out, key=lambda s: sort_key(s.spec) if s.spec else (True, 0, 0, s.service))


def keep_document(backend: Backend, c: Cluster) -> None:
    """Render the document again when the topology was named and the target's commands read the file."""
    if backend.keeps_document and c.topology is not None:
        write_if_changed(c.file, backend.document(c.topology))


# --- up -------------------------------------------------------------------


def refuse_live(backend: Backend, c: Cluster, verb: str) -> None:
    """UsageError (one line) when a run of cluster `c` is live on the target: a second run of
    the same name would share its project (or stack) and state volume; or live anywhere else,
    `local` or another target (orchestrator/verbs/live_names.py)."""
    from orchestrator.backends.registry import BACKENDS

    p = backend.verb_prefix
    another = command(backend.verb("up"), NAME=c.name[:48] + "-2")
    live_names.refuse_elsewhere(c.name, backend.name, f"{p}{verb}", another, BACKENDS.values(), c.file.parent.parent)
    live = backend.running_env(c, runs.VARIABLES)
    if not live:
        return
    going = sorted(s.service for s in backend.describe(c) if s.status in ("running", "restarting"))
    raise UsageError(
        f"{p}{verb}: {backend.noun} {c.name} has a live run {live.get(runs.RUN_ID) or '(no id)'} "
        f"({backend.unit}s running: {' '.join(going) or 'none'}); give this one another name "
        f"({command(backend.verb('up'), NAME=c.name[:48] + '-2')}), "
        f"or end that one first ({command(backend.verb('down'), NAME=c.name)})"
    )


def preflight(backend: Backend, t: Topology, config: str, client: Any, out: TextIO) -> Facts:
    """The target's doctor checks; stop before starting anything when one fails (UsageError:
    the first problem and its fix, one line). The facts, for the document."""
    from orchestrator.backends.registry import DEFAULT

    check_paths(t, config, ROOT)  # `code`, train.init_weights: relative to the repository
    facts = gather(t, client=client, engine=backend.engine, target=backend.gather_facts)
    checks = run_checks(backend.checks(), t, facts)
    flag = "" if backend.name == DEFAULT else backend.name
    named = f"CONFIG={SMOKE_CONFIG}" if via_make() else SMOKE_CONFIG
    hint = f"{named} runs anywhere: {command(backend.verb('up'), CONFIG=SMOKE_CONFIG, WORKERS=3)}"
    stop_on_problems(checks, config, hint if t.cuda or t.reads_files else "", target=flag)
    doctor = "python -m orchestrator doctor" + (f" --target {flag}" if flag else "")
    print(f"==> doctor: {summary(checks)} ({doctor} lists them)", file=out, flush=True)
    return facts


@engine_errors
def up(
    backend: Backend,
    config: str,
    workers: Optional[int] = None,
    *,
    strategy: Optional[str] = None,
    offline: bool = False,
    resume: runs.Resume = False,
    name: Optional[str] = None,
    remember: bool = True,
    out: Optional[TextIO] = None,
    overrides: tuple[str, ...] = (),
    files: Sequence[str] = (),
) -> int:
    """A new run (orchestrator.runs: its own id; `resume`: the PS continues the newest
    unfinished checkpoint) of the topology, under `name` when given; refused (one line) while a
    run of that name is live on the target."""
    out = out or sys.stdout
    backend.refuse("up")
    t = load_with(config, workers=workers, strategy=strategy, name=name, overrides=overrides)
    refused = tracking.auth_refusal(t, os.environ)
    if refused is not None:
        raise UsageError(refused)
    name = backend.name_of(t)
    c = Cluster(name, backend.path_of(name), config, workers, strategy, t, files=override_files(files))
    if c.files and not backend.merges_files:
        backend.check_files(c)  # one line before anything starts: the target merges no override file
    p = backend.verb_prefix
    # the check for a live run and the start, one `up` of the name at a time (run_lock.starting)
    with run_lock.starting(c.file.parent, f"{p}up", f"{backend.noun} {c.name}"):
        client = images.client() if backend.engine else None
        refuse_live(backend, c, "up")
        if runs.chosen(resume):
            from orchestrator.verbs import inventory  # its runs, as `runs` lists them

            inventory.check_resumable(c.name, backend.name, backend.read_records(c, PS_SERVICE), runs.chosen(resume))
        facts = preflight(backend, t, config, client, out)
        wrote = write_if_changed(c.file, backend.document(t, facts))
        said = "rendered" if wrote else "up to date:"
        print(f"==> {said} {relative(c.file)}: {describe(t)}, {backend.noun} {c.name}", file=out, flush=True)
        if c.files:
            backend.check_files(c)
            merged = " ".join(f"-f {f}" for f in c.files)
            print(f"==> compose merges {merged} over it (recorded: later verbs of {c.name} merge it too)", file=out)
        versions = ensure_image(backend, client, t, offline, out)
        if user_packages.record(c.file.parent, versions):
            print(f"==> image.packages: {user_packages.described(versions)}", file=out, flush=True)
        unset = t.env_unset(os.environ)
        if unset:
            print(f"warning: {unset}", file=out, flush=True)
        env, line = runs.start(backend.running_env(c, runs.VARIABLES), resume)
        print(f"==> {line}", file=out, flush=True)
        for problem in backend.deploy(c, env, out):
            print(f"warning: {problem}", file=out, flush=True)
        if remember:
            record.save(backend, c)
    steps = " | ".join(command(backend.verb(verb)) for verb in ("logs", "status", "down"))
    print(f"==> up: {backend.noun} {c.name}. Next: {steps}", file=out, flush=True)
    if tracking.tracked_by_own_server(t):
        who = f", user {os.environ.get(tracking.AUTH_USER) or tracking.AUTH_DEFAULT_USER}" if t.tracking.auth else ""
        where = f"{tracking.ui_address()} (experiment {c.name}{who})"
        print(f"==> MLflow: the run is tracked at {where}", file=out, flush=True)
    return 0


# --- down, logs, status ---------------------------------------------------


def _has_own_tracker(c: Cluster) -> bool:
    """Whether the cluster has the project's own MLflow server (its topology, else its document)."""
    if c.topology is not None:
        return tracking.tracked_by_own_server(c.topology)
    try:
        doc = yaml.safe_load(c.file.read_text())
    except (OSError, yaml.YAMLError):
        return False
    return isinstance(doc, dict) and tracking.MLFLOW_SERVICE in (doc.get("services") or {})


@engine_errors
def down(
    backend: Backend,
    config: Optional[str] = None,
    workers: Optional[int] = None,
    *,
    strategy: Optional[str] = None,
    volumes: bool = False,
    name: Optional[str] = None,
    out: Optional[TextIO] = None,
    files: Sequence[str] = (),
) -> int:
    out = out or sys.stdout
    backend.refuse("down")
    c = resolve(backend, config, workers, strategy, name, files)
    keep_document(backend, c)
    backend.remove(c, volumes)
    tracked = _has_own_tracker(c)
    kept = (
        ("volumes removed" if tracked else "volume removed")
        if volumes
        else f"checkpoints and metrics kept in volume {c.name}_{STATE_VOLUME}{backend.volume_where}"
        + (f", MLflow's runs in {c.name}_{tracking.MLFLOW_VOLUME}" if tracked else "")
    )
    print(f"==> down: {backend.noun} {c.name} {backend.removed}; {kept}", file=out, flush=True)
    return 0


@engine_errors
def logs(
    backend: Backend,
    config: Optional[str] = None,
    workers: Optional[int] = None,
    *,
    strategy: Optional[str] = None,
    follow: bool = True,
    name: Optional[str] = None,
    options: LogOptions = EVERY_LINE,
    out: Optional[TextIO] = None,
    files: Sequence[str] = (),
    on_end: Optional[Callable[[Backend, Cluster, str, str], None]] = None,
) -> int:
    """Every service's log; following, until every service of the cluster has ended (on two
    looks in a row, POLL apart: a failed one's restart comes a moment later), scaled ones too;
    `options`: timestamps, --tail, --since, passed to the target's command. `on_end(backend,
    cluster, tracking URI, experiment)` once it followed the cluster to its end (the run's report)."""
    out = out or sys.stdout
    backend.refuse("logs")
    c = resolve(backend, config, workers, strategy, name, files)
    keep_document(backend, c)
    lines = backend.log_iter(c, follow, options)
    done, ended = threading.Event(), threading.Event()
    if follow:
        threading.Thread(target=_close_when_ended, args=(backend, c, lines, done, ended), daemon=True).start()
    plain = not _is_terminal(out)
    try:
        for line in lines:
            if plain:
                line = without_escapes(line)
                if not line.strip():  # what compose's "\r\x1b[K<service> exited with code 0" leaves
                    continue
            out.write(line)
            out.flush()
    finally:
        done.set()
        lines.close()
    if follow and on_end is not None and (ended.is_set() or _all_ended(backend, c)):
        tracked = os.environ.get("MLFLOW_TRACKING_URI") or (tracking.ui_address() if _has_own_tracker(c) else "")
        on_end(backend, c, tracked, os.environ.get("MLFLOW_EXPERIMENT_NAME") or c.name)
    return 0 if follow else int(getattr(lines, "returncode", 0))


# A terminal control sequence: CSI (ESC [ ... final byte, e.g. the erase-line ESC [ K that compose
# v2 writes after a carriage return before "<service> exited with code N" while it follows), or
# another escape (ESC, intermediate bytes, a final byte: ESC ( B, ESC 7). The lines are read in
# text mode, so the carriage return has become a line of its own, blank: dropped too.
_ESCAPE = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|[ -/]*[0-~])")


def without_escapes(line: str) -> str:
    """`line` without terminal control sequences: what a file or a pipe should get."""
    return _ESCAPE.sub("", line)


def _is_terminal(out: TextIO) -> bool:
    try:
        return out.isatty()
    except (AttributeError, ValueError):  # a closed stream, or none that can tell
        return False


def _all_ended(backend: Backend, c: Cluster) -> bool:
    """Whether every service of the cluster has ended (one look; False when the engine does not say)."""
    try:
        return all(s.ended for s in backend.describe(c))
    except Exception:  # noqa: BLE001 - no answer: not known to have ended
        return False


def _close_when_ended(
    backend: Backend, c: Cluster, lines: LogLines, done: threading.Event, ended_event: threading.Event
) -> None:
    ended_before = False
    while not done.wait(POLL):
        try:
            states = backend.describe(c)
        except Exception:  # noqa: BLE001 - one look the engine did not answer: the next one decides
            ended_before = False
            continue
        ended = all(s.ended for s in states)
        if ended and ended_before:
            ended_event.set()
            lines.close()
            return
        ended_before = ended


@engine_errors
def status(
    backend: Backend,
    config: Optional[str] = None,
    workers: Optional[int] = None,
    *,
    strategy: Optional[str] = None,
    name: Optional[str] = None,
    as_json: bool = False,
    out: Optional[TextIO] = None,
    files: Sequence[str] = (),
) -> int:
    """One line per service; under the metrics table, the live workers and the run's progress.
    `as_json`: the same as one JSON document (backends/status.py: `status_document`)."""
    out = out or sys.stdout
    backend.refuse("status")
    c = resolve(backend, config, workers, strategy, name, files)
    rows = listed(backend, c, backend.describe(c))
    where = str(relative(Path(c.file)))
    if backend.task_table:
        if as_json:
            print(json.dumps(status_document(backend.name, c.name, where, [state_row(s) for s in rows])), file=out)
            return 0
        print(f"{backend.noun} {c.name}", file=out)
        for line in format_states(rows):
            print(line, file=out)
        return 0
    records = backend.read_records(c, PS_SERVICE)
    table = [service_row(s, records.get(s.spec.metrics_file, []) if s.spec else []) for s in rows]
    live = progress = None
    if any(s.service == PS_SERVICE for s in rows):
        running = {s.spec.rank for s in rows if s.spec and s.spec.role == "worker" and s.running}
        ps_lines = records.get(f"{PS_SERVICE}.jsonl", [])
        live, progress = live_workers(ps_lines, running), latest_progress(ps_lines)
    if as_json:
        print(json.dumps(status_document(backend.name, c.name, where, table, live, progress)), file=out)
        return 0
    print(f"{backend.noun} {c.name} ({where})", file=out)
    for line in format_status(table):
        print(line, file=out)
    if any(s.service == PS_SERVICE for s in rows):
        print(format_live(live), file=out)
        print(format_progress(progress, time.time()), file=out)
    return 0
