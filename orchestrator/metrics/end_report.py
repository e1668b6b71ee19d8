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

import base64
import json
import os
import re
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Optional, TextIO

from orchestrator.backends.base import Cluster
from orchestrator.errors import UsageError

RUN_TAG = "ps-compose.run_id"  # the tag the PS gives its MLflow run (app/training/tracking.py)
TIMEOUT = 30  # seconds for each request to the tracking server
_USER_INFO = re.compile(r"(\w+://)[^/@\s]+@")


def after_run(
    metrics: Path,
    out: TextIO,
    prefix: str,
    tracking_uri: str = "",
    experiment: str = "",
    environ: Optional[Mapping[str, str]] = None,
) -> Optional[Path]:
    """Draw the report of the newest run whose records are in `metrics` (a run's metrics/, or
    its state volume's copy) into the run's report/, say where in one line starting `prefix`,
    and log the PNGs to the run's MLflow run at `tracking_uri` (none: not tracked). The
    report's directory, or None when none was drawn."""
    from orchestrator.metrics.report import require_matplotlib, write_report
    from orchestrator.metrics.run_metrics import load_run

    try:
        require_matplotlib()
        run = load_run(metrics)
        target = run.path / "report"
        written = write_report([run], target)
    except UsageError as error:
        print(f"{prefix}: no report drawn: {error}", file=out)
        return None
    pngs = [p for p in written if p.suffix == ".png"]
    print(f"{prefix}: report: {', '.join(p.name for p in written)} in {target}/", file=out, flush=True)
    run_id = str((run.start or {}).get("run_id") or "")
    if tracking_uri and run_id:
        said = log_to_mlflow(tracking_uri, experiment, run_id, pngs, os.environ if environ is None else environ)
        print(f"{prefix}: {said}", file=out, flush=True)
    return target


def after_cluster(c: Cluster, tracking_uri: str, experiment: str, out: Optional[TextIO] = None) -> Optional[Path]:
    """`after_run` for a cluster `logs` followed to its end: its state volume's records, copied
    into runs/<name>/state-metrics/ (or a local run's of the same name, whichever is newer)."""
    from orchestrator.metrics.report import run_of

    out = out or sys.stdout
    try:
        metrics = run_of(c.name, c.file.parent, out)
    except UsageError as error:
        print(f"==> no report drawn: {error}", file=out)
        return None
    return after_run(metrics, out, "==>", tracking_uri, experiment)


def log_to_mlflow(uri: str, experiment: str, run_id: str, files: list[Path], environ: Mapping[str, str]) -> str:
    """Upload `files` as the artifact directory `report/` of the MLflow run tagged `run_id` in
    `experiment`; one line saying what was done."""
    server = MLflowServer(uri, environ)
    try:
        found = server.run_of(experiment, run_id)
        if found is None:
            return f"report not logged to MLflow at {server.shown}: no run {run_id} in experiment {experiment}"
        root = server.artifact_root(found)
        if root is None:
            where = found.get("info", {}).get("artifact_uri", "")
            return f"report not logged to MLflow: run {run_id}'s artifacts are at {shown(where)}, not on {server.shown}"
        for path in files:
            server.put(f"{root}/report/{path.name}", path.read_bytes())
    except (OSError, ValueError, KeyError, TypeError) as error:  # unreachable, refused, an answer not MLflow's
        return f"report not logged to MLflow at {server.shown} ({shown(_line(error))})"
    return f"report logged to MLflow run {run_id} as report/ ({len(files)} PNGs)"


class MLflowServer:
    """The few REST calls of a tracking server the report needs, with MLflow's own credentials
    (MLFLOW_TRACKING_USERNAME and _PASSWORD, or MLFLOW_TRACKING_TOKEN) from `environ`."""

    def __init__(self, uri: str, environ: Mapping[str, str]) -> None:
        parts = urllib.parse.urlsplit(uri.rstrip("/"))
        user, password = parts.username or "", parts.password or ""
        host = parts.hostname or ""
        netloc = (f"[{host}]" if ":" in host else host) + (f":{parts.port}" if parts.port else "")
        self.base = urllib.parse.urlunsplit(parts._replace(netloc=netloc))  # without the user and password
        self.shown = shown(uri)
        user = environ.get("MLFLOW_TRACKING_USERNAME", user)
        password = environ.get("MLFLOW_TRACKING_PASSWORD", password)
        token = environ.get("MLFLOW_TRACKING_TOKEN", "")
        self.headers: dict[str, str] = {}
        if user and password:
            self.headers["Authorization"] = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
        elif token:
            self.headers["Authorization"] = f"Bearer {token}"

    def run_of(self, experiment: str, run_id: str) -> Optional[dict]:
        """The first MLflow run tagged `run_id` in `experiment` (the PS's), or None."""
        query = urllib.parse.urlencode({"experiment_name": experiment})
        try:
            found = self._call("GET", f"/api/2.0/mlflow/experiments/get-by-name?{query}")
        except urllib.error.HTTPError as error:
            if error.code == 404:
                return None
            raise
        search = {
            "experiment_ids": [found["experiment"]["experiment_id"]],
            "filter": f"tags.`{RUN_TAG}` = '{run_id}'",
            "order_by": ["attributes.start_time ASC"],
            "max_results": 1,
        }
        runs = self._call("POST", "/api/2.0/mlflow/runs/search", json.dumps(search).encode()).get("runs", [])
        return runs[0] if runs else None

    def artifact_root(self, run: dict) -> Optional[str]:
        """The proxy's path of the run's artifacts, where they are `mlflow-artifacts:`; else None."""
        where = urllib.parse.urlsplit(run["info"]["artifact_uri"])
        if where.scheme != "mlflow-artifacts":
            return None
        return "/api/2.0/mlflow-artifacts/artifacts/" + where.path.strip("/")

    def put(self, path: str, data: bytes) -> None:
        self._call("PUT", urllib.parse.quote(path), data, content_type="image/png" if path.endswith(".png") else "")

    def _call(self, method: str, path: str, data: Optional[bytes] = None, content_type: str = "") -> dict:
        headers = dict(self.headers)
        if data is not None:
            headers["Content-Type"] = content_type or "application/json"
        request = urllib.request.Request(self.base + path, data=data, method=method, headers=headers)
        with urllib.request.urlopen(request, timeout=TIMEOUT) as answer:
            body = answer.read()
        return json.loads(body) if body.strip() else {}


def shown(text: str) -> str:
    """`text` with the user and password of every URI in it left out."""
    return _USER_INFO.sub(r"\1***@", text)


def _line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]
