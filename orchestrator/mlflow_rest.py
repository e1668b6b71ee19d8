"""The few calls of an MLflow tracking server's REST API the host makes, with the standard library
(the host's venv holds no MLflow client): find or open the run a PS tagged with its run id, log
metrics and parameters in batches, end it, and upload files through the server's artifact proxy
(`mlflow server`'s default, and the project's own server's), as MLflow's own client does for an
`mlflow-artifacts:` store. Credentials are MLflow's own variables (MLFLOW_TRACKING_USERNAME and
_PASSWORD, or MLFLOW_TRACKING_TOKEN); a URI's user and password are never printed."""

from __future__ import annotations

import base64
import json
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any, Optional

from app.contract import MLFLOW_RUN_TAG, shown

TIMEOUT = 30  # seconds for each request
BATCH_METRICS, BATCH_PARAMS = 1000, 100  # MLflow's limits on one log-batch request


class MLflowServer:
    """One tracking server, as the host reaches it."""

    def __init__(self, uri: str, environ: Mapping[str, str], timeout: float = TIMEOUT) -> None:
        parts = urllib.parse.urlsplit(uri.rstrip("/"))
        host = parts.hostname or ""
        netloc = (f"[{host}]" if ":" in host else host) + (f":{parts.port}" if parts.port else "")
        self.base = urllib.parse.urlunsplit(parts._replace(netloc=netloc))  # without the user and password
        self.shown, self.timeout = shown(uri), timeout
        user = environ.get("MLFLOW_TRACKING_USERNAME", parts.username or "")
        password = environ.get("MLFLOW_TRACKING_PASSWORD", parts.password or "")
        token = environ.get("MLFLOW_TRACKING_TOKEN", "")
        self.headers: dict[str, str] = {}
        if user and password:
            self.headers["Authorization"] = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
        elif token:
            self.headers["Authorization"] = f"Bearer {token}"

    def experiment_id(self, name: str, create: bool = False) -> Optional[str]:
        """The experiment's id; None where there is none (made, with `create`)."""
        query = urllib.parse.urlencode({"experiment_name": name})
        try:
            found = self._call("GET", f"/api/2.0/mlflow/experiments/get-by-name?{query}")
            return str(found["experiment"]["experiment_id"])
        except urllib.error.HTTPError as error:
            if error.code != 404:
                raise
        if not create:
            return None
        return str(self._call("POST", "/api/2.0/mlflow/experiments/create", {"name": name})["experiment_id"])

    def run_of(self, experiment_id: str, run_id: str) -> Optional[dict]:
        """The first MLflow run tagged `run_id` in the experiment (the PS's), or None."""
        search = {
            "experiment_ids": [experiment_id],
            "filter": f"tags.`{MLFLOW_RUN_TAG}` = '{run_id}'",
            "order_by": ["attributes.start_time ASC"],
            "max_results": 1,
        }
        runs = self._call("POST", "/api/2.0/mlflow/runs/search", search).get("runs", [])
        return runs[0] if runs else None

    def create_run(self, experiment_id: str, run_id: str) -> dict:
        """A new MLflow run named and tagged `run_id`, as the PS opens one."""
        body = {
            "experiment_id": experiment_id,
            "run_name": run_id,
            "start_time": int(time.time() * 1000),
            "tags": [{"key": MLFLOW_RUN_TAG, "value": run_id}],
        }
        return self._call("POST", "/api/2.0/mlflow/runs/create", body)["run"]

    def log_batch(self, run_uuid: str, metrics: Sequence[dict] = (), params: Mapping[str, str] = {}) -> None:
        """`metrics` ({key, value, timestamp, step}) and `params`, in requests MLflow takes."""
        for i in range(0, len(metrics), BATCH_METRICS):
            self._call(
                "POST",
                "/api/2.0/mlflow/runs/log-batch",
                {"run_id": run_uuid, "metrics": list(metrics[i : i + BATCH_METRICS])},
            )
        items = [{"key": k, "value": v} for k, v in sorted(params.items())]
        for i in range(0, len(items), BATCH_PARAMS):
            self._call(
                "POST", "/api/2.0/mlflow/runs/log-batch", {"run_id": run_uuid, "params": items[i : i + BATCH_PARAMS]}
            )

    def end_run(self, run_uuid: str, status: str) -> None:
        self._call(
            "POST",
            "/api/2.0/mlflow/runs/update",
            {"run_id": run_uuid, "status": status, "end_time": int(time.time() * 1000)},
        )

    def artifact_root(self, run: dict) -> Optional[str]:
        """The proxy's path of the run's artifacts, where they are `mlflow-artifacts:`; else None."""
        where = urllib.parse.urlsplit(run["info"]["artifact_uri"])
        if where.scheme != "mlflow-artifacts":
            return None
        return "/api/2.0/mlflow-artifacts/artifacts/" + where.path.strip("/")

    def put(self, path: str, data: bytes) -> None:
        """Upload `data` to `path` under an artifact_root."""
        self._call("PUT", urllib.parse.quote(path), data, content_type="application/octet-stream")

    def _call(self, method: str, path: str, body: Any = None, content_type: str = "") -> dict:
        headers = dict(self.headers)
        data = None
        if body is not None:
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            headers["Content-Type"] = content_type or "application/json"
        request = urllib.request.Request(self.base + path, data=data, method=method, headers=headers)
        with urllib.request.urlopen(request, timeout=self.timeout) as answer:
            text = answer.read()
        return json.loads(text) if text.strip() else {}


def failure(error: BaseException) -> str:
    """One line for a failed call, with no password in it."""
    lines = str(error).strip().splitlines()
    return shown(f"{type(error).__name__}: {lines[0] if lines else ''}")[:300]
