"""`runs`, `runs show`, `runs rm`: every run this host knows, after `torchx list` and `docker
compose ls`.

A run is one id (orchestrator/runs.py) of one name on one target: its processes wrote it into
their `start` records, so the metrics files of a name (the PS's, else worker1's: allreduce has
no PS) hold its runs one after another. The runs are found where their state lives:

- local: `runs/<name>/metrics/` of `orchestrator local`; live while runs/<name>/local.lock is
  held (orchestrator/run_lock.py);
- compose, swarm: the cluster of each record of an up (runs/<name>/up.json, stack-up.json,
  orchestrator/backends/record.py) and each project with a state volume on the engine; its
  metrics read from the volume (the target's `read_records` block), live while a container (a
  task) runs with its id (`running_env`).

A row: name, run id, target, state (running, finished: its `end` record; stopped: neither),
started (the `start` record's time, UTC), steps, the headline metric and its value, where its
state lives. `--json` gives the rows as one JSON document (a list, the same keys each).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Optional, TextIO

from app.contract import Event
from orchestrator import paths, run_lock, runs
from orchestrator.arguments import Parser, add_json_arg
from orchestrator.backends import record
from orchestrator.backends.base import Backend, Cluster
from orchestrator.backends.status import summarize_metrics
from orchestrator.errors import EngineError, UsageError, engine_errors
from orchestrator.hints import command
from orchestrator.metrics.records import is_event, parse_line
from orchestrator.render.compose import STATE_VOLUME
from orchestrator.topology.services import PS_SERVICE
from orchestrator.verbs import mlflow_sync
from orchestrator.verbs.local import RUNS_DIR

LOCAL = "local"
KEYS = ("name", "run_id", "target", "state", "started", "steps", "metric", "value", "where")
LOCAL_VOLUMES = ("checkpoints", "metrics")  # a local run's state: what --volumes removes


def segments(records: dict[str, list[str]]) -> dict[str, list[str]]:
    """{run id: its lines} of the PS's metrics file (else worker1's), in the order they ran:
    each `start` record with a run id opens one (a restarted PS's `start` of the same id goes on),
    and the `resume` record a PS writes before it, of another run's checkpoint, is neither's."""
    lines = records.get(f"{PS_SERVICE}.jsonl") or records.get("worker1.jsonl") or []
    out: dict[str, list[str]] = {}
    current: Optional[str] = None
    for line in lines:
        rec = parse_line(line)
        if rec is None:
            continue
        if is_event(rec, Event.START) and rec.get("run_id"):
            current = str(rec["run_id"])
        elif is_event(rec, Event.RESUME) and rec.get("run_id") != current:
            continue  # a PS's first record, of the checkpoint it resumes, before its own `start`
        if current is not None:
            out.setdefault(current, []).append(line)
    return out


def _started(lines: list[str]) -> Optional[str]:
    for line in lines:
        rec = parse_line(line)
        if rec is not None and is_event(rec, Event.START) and isinstance(rec.get("time"), (int, float)):
            return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(rec["time"]))
    return None


def rows_of(name: str, target: str, where: str, records: dict[str, list[str]], live: Optional[str]) -> list[dict]:
    """One row per run of `name`, oldest first; `live`: the id of the run going on (None: none)."""
    found = segments(records)
    if live and live not in found:  # started, nothing written yet
        found[live] = []
    rows = []
    for run_id, lines in found.items():
        summary = summarize_metrics(lines)
        state = "running" if run_id == live else "finished" if summary["event"] == Event.END else "stopped"
        rows.append(
            {
                "name": name,
                "run_id": run_id,
                "target": target,
                "state": state,
                "started": _started(lines),
                "steps": summary["step"],
                "metric": summary["metric"],
                "value": summary["value"],
                "where": where,
            }
        )
    return rows


def check_resumable(name: str, target: str, records: dict[str, list[str]], run_id: str) -> None:
    """`--resume RUN_ID`: UsageError (one line) unless `run_id` is an unfinished run of `name` on
    `target`, by the PS's metrics `records`."""
    rows = {r["run_id"]: r for r in rows_of(name, target, "", records, None)}
    row = rows.get(run_id)
    if row is None:
        known = ", ".join(rows) or "none yet"
        raise UsageError(f"--resume: got {run_id!r}; {name} ({target}) has no run of that id (its runs: {known})")
    if row["state"] == "finished":
        raise UsageError(
            f"--resume: got {run_id!r}; that run of {name} finished at step {row['steps']}: nothing to resume"
        )


# --- where runs are ----------------------------------------------------------


def local_dirs(base: Path) -> list[Path]:
    """The directories of `orchestrator local`'s runs under `base` (those with metrics/)."""
    try:
        return sorted(d for d in base.iterdir() if (d / "metrics").is_dir())
    except OSError:
        return []


def local_records(d: Path) -> dict[str, list[str]]:
    """{file name: lines} of the PS's and worker1's metrics of the local runs in `d`."""
    records = {}
    for file in (f"{PS_SERVICE}.jsonl", "worker1.jsonl"):
        try:
            records[file] = (d / "metrics" / file).read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError:
            continue
    return records


def check_local_resume(name: str, run_id: str, runs_dir: str = RUNS_DIR) -> None:
    """`local --resume RUN_ID`: check_resumable over the local runs of `name` (under `runs_dir`)."""
    check_resumable(name, LOCAL, local_records(Path(runs_dir) / name), run_id)


def local_rows(base: Path) -> list[dict]:
    rows = []
    for d in local_dirs(base):
        rows += rows_of(d.name, LOCAL, f"{d}/", local_records(d), run_lock.live_run(d))
    return rows


def recorded_names(backend: Backend, base: Path) -> list[str]:
    """The names with a record of an up of `backend` under `base` (runs/<name>/up.json)."""
    try:
        return sorted(d.name for d in base.iterdir() if record.path(backend, base, d.name).is_file())
    except OSError:
        return []


def cluster_of(backend: Backend, name: str, base: Path) -> Cluster:
    return record.load(backend, base, name) or Cluster(name, backend.path_of(name))


def cluster_rows(backend: Backend, base: Path, err: TextIO) -> list[dict]:
    """The runs of every cluster of `backend` this host has a record or a state volume of;
    a target whose engine does not answer is one line on `err`, and no rows."""
    try:
        names = sorted(set(recorded_names(backend, base)) | set(backend.known_clusters()))
        rows = []
        for name in names:
            c = cluster_of(backend, name, base)
            live = backend.running_env(c, runs.VARIABLES).get(runs.RUN_ID)
            where = f"volume {name}_{STATE_VOLUME}{backend.volume_where}"
            rows += rows_of(name, backend.name, where, backend.read_records(c, PS_SERVICE), live or None)
        return rows
    except Exception as e:  # noqa: BLE001 - the local runs are still listed
        print(
            f"runs: target {backend.name} not read: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=err
        )
        return []


def engine_targets(target: Optional[str]) -> list[Backend]:
    from orchestrator.backends.registry import BACKENDS

    return [
        b for b in BACKENDS.values() if b.verb_prefix is not None and b.record and (target is None or target == b.name)
    ]


def all_rows(base: Path, target: Optional[str], err: TextIO) -> list[dict]:
    """`base`: the records' runs/ (paths.RUNS); local's runs are under runs/ where it ran."""
    rows = local_rows(Path(RUNS_DIR)) if target in (None, LOCAL) else []
    for backend in engine_targets(target):
        if backend.name == "swarm" and not recorded_names(backend, base):
            continue  # no stack-up here: the swarm is not asked (it may not be one)
        rows += cluster_rows(backend, base, err)
    return rows


# --- the verbs ---------------------------------------------------------------


def _num(v: Any) -> str:
    return "-" if v is None else f"{v:.4f}" if isinstance(v, float) else str(v)


def table(rows: Iterable[dict]) -> list[str]:
    lines = [f"{'NAME':<20} {'RUN ID':<22} {'TARGET':<8} {'STATE':<9} {'STARTED':<20} {'STEPS':>6}  METRIC  WHERE"]
    for r in rows:
        metric = f"{r['metric']} {_num(r['value'])}" if r["value"] is not None else "-"
        lines.append(
            f"{r['name']:<20} {r['run_id']:<22} {r['target']:<8} {r['state']:<9} {r['started'] or '-':<20} "
            f"{_num(r['steps']):>6}  {metric}  {r['where']}"
        )
    return lines


def list_runs(
    base: Optional[Path] = None,
    *,
    target: Optional[str] = None,
    as_json: bool = False,
    out: Optional[TextIO] = None,
    err: Optional[TextIO] = None,
) -> int:
    out, err = out or sys.stdout, err or sys.stderr
    rows = all_rows(base or paths.RUNS, target, err)
    if as_json:
        print(json.dumps(rows), file=out)
    else:
        for line in table(rows):
            print(line, file=out)
    return 0


def show(
    key: str,
    base: Optional[Path] = None,
    *,
    target: Optional[str] = None,
    as_json: bool = False,
    out: Optional[TextIO] = None,
    err: Optional[TextIO] = None,
) -> int:
    """One run: by its id, or a name's newest run (UsageError naming what exists when none)."""
    out, err = out or sys.stdout, err or sys.stderr
    rows = all_rows(base or paths.RUNS, target, err)
    found = [r for r in rows if r["run_id"] == key] or [r for r in rows if r["name"] == key]
    if not found:
        have = ", ".join(sorted({r["name"] for r in rows})) or "none"
        raise UsageError(f"runs show: {key!r} is no run id or name of a run on this host; names: {have}")
    on = sorted({r["target"] for r in found})
    if len(on) > 1:
        raise UsageError(f"runs show: {key} has runs on {' and '.join(on)}; say which with --target {on[0]}")
    r = found[-1]  # a name: its newest run
    if as_json:
        print(json.dumps(r), file=out)
    else:
        for k in KEYS:
            print(f"{k + ':':<9} {_num(r[k]) if k in ('steps', 'value') else r[k] or '-'}", file=out)
    return 0


def remove(
    name: str,
    base: Optional[Path] = None,
    *,
    target: Optional[str] = None,
    volumes: bool = False,
    out: Optional[TextIO] = None,
) -> int:
    """Remove the runs of `name` on its target (`target` when it has them on more than one):
    refused (one line) while one runs; the state (local: checkpoints/ and metrics/; a cluster:
    its volume) only with `volumes`."""
    out = out or sys.stdout
    base = base or paths.RUNS
    local = (Path(RUNS_DIR) / name / "metrics").is_dir()
    where = [LOCAL] if local else []
    where += [
        b.name
        for b in engine_targets(None)
        if (target in (None, b.name)) and (record.path(b, base, name).is_file() or _holds(b, name, local))
    ]
    if target is not None:
        where = [t for t in where if t == target] or ([target] if target != LOCAL else [])
    if not where:
        raise UsageError(f"runs rm: no run named {name!r} on this host (ps-compose runs lists them)")
    if len(where) > 1:
        raise UsageError(f"runs rm: {name} has runs on {' and '.join(where)}; say which with --target {where[0]}")
    if where[0] == LOCAL:
        return _remove_local(Path(RUNS_DIR) / name, volumes, out)
    from orchestrator.backends.registry import get

    return _remove_cluster(get(where[0]), name, base, volumes, out)


def _holds(backend: Backend, name: str, local: bool) -> bool:
    """Whether `backend`'s engine holds a state volume of `name`. An engine that does not
    answer holds none when `name` has a local run (that one is removed without it), and is
    the error otherwise."""
    try:
        return name in backend.known_clusters()
    except EngineError:
        if local:
            return False
        raise


def _remove_local(d: Path, volumes: bool, out: TextIO) -> int:
    live = run_lock.live_run(d)
    if live is not None:
        raise UsageError(
            f"runs rm: {d.name} has a live local run {live or '(id unknown)'}; stop it first (Ctrl-C in its terminal)"
        )
    if volumes:
        shutil.rmtree(d)
        print(f"==> runs rm: local {d.name} removed with its state ({d}/)", file=out)
        return 0
    for entry in d.iterdir():
        if entry.name in LOCAL_VOLUMES:
            continue
        shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    print(
        f"==> runs rm: local {d.name} removed; its checkpoints and metrics kept in {d}/ (--volumes removes them)",
        file=out,
    )
    return 0


def _remove_cluster(backend: Backend, name: str, base: Path, volumes: bool, out: TextIO) -> int:
    c = cluster_of(backend, name, base)
    live = backend.running_env(c, runs.VARIABLES)
    if live:
        raise UsageError(
            f"runs rm: {backend.noun} {name} has a live run {live.get(runs.RUN_ID) or '(no id)'}; "
            f"end it first ({command(backend.verb('down'), NAME=name)}), then runs rm {name}"
        )
    if not Path(c.file).is_file():  # no record, no document: only its state volume is left
        if not volumes:
            raise UsageError(
                f"runs rm: of {backend.noun} {name} only its state is left (volume {name}_{STATE_VOLUME}); "
                "--volumes removes it"
            )
        backend.remove_state(name)
        print(f"==> runs rm: {backend.noun} {name}: its volume removed", file=out)
        return 0
    backend.remove(c, volumes)
    for file in (record.path(backend, base, name), c.file):
        Path(file).unlink(missing_ok=True)
    kept = "its volume removed" if volumes else f"its state kept in volume {name}_{STATE_VOLUME} (--volumes removes it)"
    print(f"==> runs rm: {backend.noun} {name} removed ({backend.removed}); {kept}", file=out)
    return 0


# --- the command line --------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser, names: list[str]) -> None:
    """`runs [--target T] [--json]`, `runs show NAME|RUN_ID`, `runs rm NAME [--volumes]`, `runs
    sync [NAME]`; `names`: the targets."""

    def target_arg(q: argparse.ArgumentParser, what: str) -> None:
        q.add_argument("--target", choices=names, help=f"{what} (default: every one)")

    target_arg(p, "only the runs of this target")
    add_json_arg(p, "the runs")
    p.set_defaults(run=lambda a: list_runs(target=a.target, as_json=a.json))
    actions = p.add_subparsers(dest="action", metavar="ACTION", parser_class=Parser)
    q = actions.add_parser("show", help="one run: by its id, or a name's newest run")
    q.add_argument("run_key", metavar="NAME|RUN_ID")
    target_arg(q, "where the name's runs are, when on more than one")
    add_json_arg(q, "the run")
    q.set_defaults(run=engine_errors(lambda a: show(a.run_key, target=a.target, as_json=a.json)))
    q = actions.add_parser("rm", help="remove a name's runs (never while one runs); its state only with --volumes")
    q.add_argument("run_name", metavar="NAME")
    target_arg(q, "where the runs are, when on more than one")
    q.add_argument(
        "-v", "--volumes", action="store_true", help="also its state: the volume (local: checkpoints/, metrics/)"
    )
    q.set_defaults(run=engine_errors(lambda a: remove(a.run_name, target=a.target, volumes=a.volumes)))
    q = actions.add_parser(
        "sync",
        help="send MLflow what it had not taken when a local run ended (kept in its metrics/mlflow-pending/)",
    )
    q.add_argument("run_name", metavar="NAME", nargs="?", help="that name's runs (default: every local run here)")
    q.set_defaults(run=lambda a: mlflow_sync.sync(a.run_name))
