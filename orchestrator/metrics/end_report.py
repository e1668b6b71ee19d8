"""The report at the end of every run: `local`'s, and a cluster's once `logs` has followed it to
its end. Its PNGs and summary.txt are written to `runs/<name>/report/` (as `report` writes them),
one line names them, and where the run was tracked in MLflow they join it as the artifact
`report/`. Nothing here fails the run: a step that cannot be done says why in one line.

MLflow is reached over its REST API with the standard library (the host's venv holds no MLflow
client): the run is the one the PS tagged with the run id, and its files go through the tracking
server's artifact proxy (`mlflow server`'s default, and the project's own server's), the way
MLflow's own client uploads to an `mlflow-artifacts:` store. A run whose artifacts live elsewhere
(an object store the server does not proxy) gets one line instead. A tracking URI's password is
never printed."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Optional, TextIO

from orchestrator.backends.base import Backend, Cluster
from orchestrator.errors import UsageError
from orchestrator.mlflow_rest import MLflowServer, failure, shown
from orchestrator.topology.services import PS_SERVICE
from orchestrator.verbs import mlflow_sync


def after_run(
    metrics: Path,
    out: TextIO,
    prefix: str,
    tracking_uri: str = "",
    experiment: str = "",
    environ: Optional[Mapping[str, str]] = None,
) -> Optional[Path]:
    """Draw the report of the newest run whose records are in `metrics` (a run's metrics/, or
    its state volume's copy) into the run's report/, say where in one line starting `prefix` ("local:", "==>"),
    and log the PNGs to the run's MLflow run at `tracking_uri` (none: not tracked). The
    report's directory, or None when none was drawn."""
    from orchestrator.metrics.report import require_matplotlib, write_report
    from orchestrator.metrics.run_metrics import load_run

    environ = os.environ if environ is None else environ
    for kept in mlflow_sync.kept_in(metrics):  # what MLflow had not taken at the end: sent now if it answers
        print(f"{prefix} {mlflow_sync.send(kept, environ, timeout=10)[0]}", file=out, flush=True)
    try:
        require_matplotlib()
        run = load_run(metrics)
        target = run.path / "report"
        written = write_report([run], target)
    except UsageError as error:
        print(f"{prefix} no report drawn: {error}", file=out)
        return None
    pngs = [p for p in written if p.suffix == ".png"]
    print(f"{prefix} report: {', '.join(p.name for p in written)} in {target}/", file=out, flush=True)
    run_id = str((run.start or {}).get("run_id") or "")
    if tracking_uri and run_id:
        said = log_to_mlflow(tracking_uri, experiment, run_id, pngs, environ)
        print(f"{prefix} {said}", file=out, flush=True)
    return target


def after_cluster(
    backend: Backend, c: Cluster, tracking_uri: str, experiment: str, out: Optional[TextIO] = None
) -> Optional[Path]:
    """`after_run` for a cluster `logs` followed to its end: what its PS kept for MLflow sent
    where the server answers now, then the report of its state's records (the target's
    read_records), copied into runs/<name>/state-metrics/. Nothing is said of a cluster whose
    records the target does not give (no run wrote any)."""
    out = out or sys.stdout
    try:
        mlflow_sync.sync_cluster(backend, c, os.environ, out, prefix="==>", timeout=10)
    except Exception as error:  # noqa: BLE001 - the report is drawn all the same
        print(f"==> what MLflow had not taken was not read ({failure(error)})", file=out)
    try:
        files = backend.read_records(c, PS_SERVICE) or backend.read_records(c, "worker1")  # allreduce: no PS
    except Exception as error:  # noqa: BLE001 - the run has ended all the same
        print(f"==> no report drawn: the state of {c.name} was not read ({failure(error)})", file=out)
        return None
    if not files:
        return None
    copy = c.file.parent / "state-metrics"
    try:
        copy.mkdir(parents=True, exist_ok=True)
        for old in copy.glob("*.jsonl"):
            old.unlink()
        for name, lines in files.items():
            (copy / name).write_text("\n".join(lines) + "\n", encoding="utf-8")
    except OSError as error:
        print(f"==> no report drawn: {copy}: {error.strerror or error}", file=out)
        return None
    return after_run(copy, out, "==>", tracking_uri, experiment)


def log_to_mlflow(uri: str, experiment: str, run_id: str, files: list[Path], environ: Mapping[str, str]) -> str:
    """Upload `files` as the artifact directory `report/` of the MLflow run tagged `run_id` in
    `experiment`; one line saying what was done."""
    server = MLflowServer(uri, environ)
    try:
        experiment_id = server.experiment_id(experiment)
        found = server.run_of(experiment_id, run_id) if experiment_id is not None else None
        if found is None:
            return f"report not logged to MLflow at {server.shown}: no run {run_id} in experiment {experiment}"
        root = server.artifact_root(found)
        if root is None:
            where = shown(found["info"]["artifact_uri"])
            return f"report not logged to MLflow: run {run_id}'s artifacts are at {where}, not on {server.shown}"
        for path in files:
            server.put(f"{root}/report/{path.name}", path.read_bytes())
    except (OSError, ValueError, KeyError, TypeError) as error:  # unreachable, refused, an answer not MLflow's
        return f"report not logged to MLflow at {server.shown} ({failure(error)})"
    return f"report logged to MLflow run {run_id} as report/ ({len(files)} PNGs)"
