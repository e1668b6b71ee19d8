"""`ps-compose runs sync [NAME]`: what MLflow had not taken when a run ended, sent now.

A PS whose tracking server did not answer at the run's end keeps what it had not sent in
`<metrics dir>/mlflow-pending/<run id>/` (app/training/tracking_pending.py: the records in order,
the model's files). A sync sends them to the run's MLflow run, the one the PS opened (its tag),
or a new one where the PS never reached the server: the parameters, every point (each keeps its
step and time: a point sent twice is the same point), the model's files through the server's
artifact proxy, and the run's end; the kept directory is then removed. Until the server answers
it stays, and one line says why.

The server is MLFLOW_TRACKING_URI where the caller sets it (with MLflow's credential variables),
else the one the PS used, as it recorded it (without a password). A local run's are in
runs/<name>/metrics/; a compose cluster's in its state volume, read and then removed through
the engine (the target's read_kept and drop_kept blocks)."""

from __future__ import annotations

import io
import json
import os
import shutil
import sys
import tarfile
import tempfile
import urllib.error
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional, TextIO

from app.contract import MLFLOW_PENDING_DIR, mlflow_points
from orchestrator import paths
from orchestrator.backends import record
from orchestrator.backends.base import Backend, Cluster
from orchestrator.errors import UsageError
from orchestrator.mlflow_rest import MLflowServer, failure, shown
from orchestrator.verbs.local import RUNS_DIR

RUN, RECORDS, FILES = "run.json", "records.jsonl", "files"  # app/training/tracking_pending.py's layout


def kept_runs(base: Path, name: Optional[str] = None) -> list[Path]:
    """The kept directories of the local runs in `base` (of `name` alone where given), oldest first."""
    return sorted(
        (kept for metrics in sorted(base.glob(f"{name or '*'}/metrics")) for kept in kept_in(metrics)),
        key=lambda d: d.stat().st_mtime,
    )


def kept_in(metrics: Path) -> list[Path]:
    """The kept directories of the runs whose records are in `metrics`."""
    return sorted(p.parent for p in (metrics / MLFLOW_PENDING_DIR).glob(f"*/{RECORDS}"))


def sync(name: Optional[str] = None, out: Optional[TextIO] = None, environ: Optional[Mapping[str, str]] = None) -> int:
    """Send every kept run of `name` (else of every run here: local runs, and the compose
    clusters with a record or a state volume); 0 when nothing is left kept."""
    out = out or sys.stdout
    environ = os.environ if environ is None else environ
    base = Path(RUNS_DIR)
    clusters = _clusters(name, out)
    if name is not None and not (base / name).is_dir() and not clusters:
        raise UsageError(f"runs sync {name}: no run of that name here ({base / name} does not exist)")
    sent = []
    for directory in kept_runs(base, name):
        said, done = send(directory, environ)
        print(f"runs sync: {said}", file=out, flush=True)
        sent.append(done)
    for backend, c in clusters:
        sent += sync_cluster(backend, c, environ, out)
    if not sent:
        print(
            f"runs sync: nothing kept for MLflow{f' of {name}' if name else ''}; every run's records were taken",
            file=out,
        )
    return 0 if all(sent) else 1


def sync_cluster(
    backend: Backend,
    c: Cluster,
    environ: Mapping[str, str],
    out: TextIO,
    prefix: str = "runs sync:",
    timeout: float = 30,
) -> list[bool]:
    """Send what the cluster's PS kept in its state volume, and remove each run's once sent;
    whether each kept run was sent."""
    data = backend.read_kept(c)
    if not data:
        return []
    sent = []
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            tar.extractall(tmp, filter="data")  # what the volume holds, nothing outside tmp
        for directory in kept_in(Path(tmp)):
            where = f"project {c.name}'s volume ({MLFLOW_PENDING_DIR}/{directory.name})"
            said, done = send(directory, environ, timeout, where)
            if done:
                backend.drop_kept(c, directory.name)
            print(f"{prefix} {said}", file=out, flush=True)
            sent.append(done)
    return sent


def _clusters(name: Optional[str], out: TextIO) -> list[tuple[Backend, Cluster]]:
    """The compose clusters of `name` (else every one) with a record here or a state volume;
    none when the engine does not answer (one line)."""
    from orchestrator.backends.registry import BACKENDS

    backend = BACKENDS["compose"]
    try:
        names = sorted(set(backend.known_clusters()) | set(_recorded(backend)))
    except Exception as error:  # noqa: BLE001 - the local runs are still synced
        print(f"runs sync: compose not read ({failure(error)})", file=out)
        return []
    chosen = [n for n in names if name in (None, n)]
    return [(backend, record.load(backend, paths.RUNS, n) or Cluster(n, backend.path_of(n))) for n in chosen]


def _recorded(backend: Backend) -> list[str]:
    try:
        return [d.name for d in paths.RUNS.iterdir() if record.path(backend, paths.RUNS, d.name).is_file()]
    except OSError:
        return []


def send(directory: Path, environ: Mapping[str, str], timeout: float = 30, where: str = "") -> tuple[str, bool]:
    """Send one kept run (kept in `where`, else `directory`) and remove its directory;
    (one line, whether it was sent)."""
    try:
        about = json.loads((directory / RUN).read_text())
        records = [json.loads(line) for line in (directory / RECORDS).read_text().splitlines() if line.strip()]
    except (OSError, ValueError) as error:
        return f"{directory}: not a kept MLflow run ({error}); left as it is", False
    run_id = str(about.get("run_name", directory.name))
    uri = environ.get("MLFLOW_TRACKING_URI") or str(about.get("server", ""))
    if not uri or "***@" in uri:
        return f"run {run_id}: set MLFLOW_TRACKING_URI to its tracking server (the PS's had a password)", False
    server = MLflowServer(uri, environ, timeout)
    try:
        counts = _send(server, str(about.get("experiment") or "ps-compose"), run_id, records, directory / FILES)
    except (OSError, ValueError, KeyError, TypeError) as error:
        why = f"HTTP {error.code}" if isinstance(error, urllib.error.HTTPError) else failure(error)
        return (
            f"run {run_id}: MLflow at {server.shown} did not take what it had not taken at the run's end ({why}); "
            f"kept in {where or directory}: `ps-compose runs sync` sends it once the server answers",
            False,
        )
    shutil.rmtree(directory, ignore_errors=True)
    return f"run {run_id}: sent to MLflow at {server.shown}: {counts}", True


def _kept_file(files: Path, relative: str) -> Path:
    """The kept file `relative` names, which must lie inside `files` (what a record names is the
    job's word, read on the host: no path out of the kept directory is followed)."""
    found = (files / relative).resolve()
    if not found.is_relative_to(files.resolve()) or not found.is_file():
        raise ValueError(f"a kept record names {relative!r}, not a file of {files}")
    return found


def _send(server: MLflowServer, experiment: str, run_id: str, records: list[dict[str, Any]], files: Path) -> str:
    """The records of one kept run, in order, to its MLflow run; what was sent, in words."""
    experiment_id = server.experiment_id(experiment, create=True)
    assert experiment_id is not None  # made where there was none
    run = server.run_of(experiment_id, run_id) or server.create_run(experiment_id, run_id)
    uuid = run["info"]["run_id"]
    params: dict[str, str] = {}
    points: list[dict[str, Any]] = []
    models: list[tuple[str, list[str]]] = []
    status = ""
    for item in records:
        kind = item["kind"]
        if kind == "params":
            params.update({str(k): str(v) for k, v in item["params"].items()})
        elif kind == "model":
            models.append((str(item["path"]), [str(f) for f in item["files"]]))
        elif kind == "close":
            status = status or str(item["status"])  # an `end` record's FINISHED stands
        elif kind in ("eval", "end", "worker"):
            step, fields = int(item["step"]), dict(item["fields"])
            points += [
                {"key": k, "value": v, "timestamp": t, "step": step} for k, v, t in mlflow_points(kind, fields, 0)
            ]
            if kind == "end":
                status = "FINISHED"
    server.log_batch(uuid, points, params)
    sent_files = 0
    if models:
        root = server.artifact_root(run)
        if root is None:
            raise ValueError(
                f"its artifacts are at {shown(run['info']['artifact_uri'])}, which the server does not serve"
            )
        for path, names in models:
            for name in names:
                server.put(f"{root}/{path}/{name}", _kept_file(files, f"{path}/{name}").read_bytes())
                sent_files += 1
    if status:
        server.end_run(uuid, status)
    return f"{len(points)} points, {len(params)} parameters, {sent_files} files" + (
        f", ended {status}" if status else ""
    )
