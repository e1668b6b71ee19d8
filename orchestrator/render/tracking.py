"""The project's own MLflow tracking server in the compose document (`tracking.mlflow: true`).

Pure, like the rest of the render: the service `mlflow` (its image: orchestrator/tracking_image.py,
images/tracking.Dockerfile), its volume, and what the PS gets from it: the tracking URI, unless
the compose call names another server in MLFLOW_TRACKING_URI, and a start after it is healthy (a
server that goes down mid-run costs the PS one warning, never the run: app.training.tracking).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Optional

from app.contract import MLFLOW_SERVER_ENV, MLFLOW_UI_ENV
from orchestrator.errors import UsageError
from orchestrator.topology.model import Topology
from orchestrator.topology.services import LABEL_PROJECT, LABEL_ROLE, has_ps

MLFLOW_SERVICE = "mlflow"
MLFLOW_VOLUME = "mlflow"  # compose calls it <project>_mlflow; `make down` keeps it, `down -v` removes it
MLFLOW_IMAGE = "ps-compose-mlflow:latest"  # one for every project: it holds no project's data
MLFLOW_DIR = "/mlflow"  # the volume inside: the sqlite store and the artifacts
MLFLOW_CONTAINER_PORT = 5000
MLFLOW_PORT = "PSC_MLFLOW_PORT"  # the host port on 127.0.0.1, from the compose call's environment
MLFLOW_URI = f"http://{MLFLOW_SERVICE}:{MLFLOW_CONTAINER_PORT}"
# The Host headers the server answers (MLflow refuses others, against DNS rebinding): the PS's
# calls over the project's network, and the UI and clients on the host's published port.
ALLOWED_HOSTS = f"{MLFLOW_SERVICE},{MLFLOW_SERVICE}:{MLFLOW_CONTAINER_PORT},localhost,localhost:*,127.0.0.1,127.0.0.1:*"
# Healthy once it answers a search of runs: the server loads that code on the first search, which
# took over 10 s on a loaded 2-core CPU VM (a PS whose first request times out tracks nothing).
# With tracking.auth, as the server's admin (the variables it was given); a refusal of those (a
# volume whose admin has another password) is an answer too: the PS then warns and trains on.
HEALTH_PROBE = (
    "import base64, os, urllib.error as e, urllib.request as u\n"
    "who = os.environ.get('MLFLOW_AUTH_ADMIN_USERNAME', '') + ':' + os.environ.get('MLFLOW_AUTH_ADMIN_PASSWORD', '')\n"
    "auth = {'Authorization': 'Basic ' + base64.b64encode(who.encode()).decode()} if who != ':' else {}\n"
    f"search = u.Request('http://127.0.0.1:{MLFLOW_CONTAINER_PORT}/api/2.0/mlflow/runs/search', "
    """data=b'{"experiment_ids": ["0"], "max_results": 1}', headers={'Content-Type': 'application/json', **auth})\n"""
    "try:\n    u.urlopen(search, timeout=30).close()\n"
    "except e.HTTPError as refused:\n    raise SystemExit(refused.code not in (401, 403))\n"
)
# tracking.auth: MLflow's basic auth, its admin the caller's MLFLOW_TRACKING_USERNAME (default
# admin) with MLFLOW_TRACKING_PASSWORD, as compose interpolates them (the file holds the names);
# its user store beside the runs, on the volume (the server's working directory). Flask's secret
# key, which MLflow's auth app wants, is drawn at each start.
AUTH_USER, AUTH_DEFAULT_USER, AUTH_PASSWORD = "MLFLOW_TRACKING_USERNAME", "admin", "MLFLOW_TRACKING_PASSWORD"
AUTH_MIN_PASSWORD = 12  # MLflow refuses a shorter admin password
AUTH_ENVIRONMENT = {
    "MLFLOW_AUTH_ADMIN_USERNAME": f"${{{AUTH_USER}:-{AUTH_DEFAULT_USER}}}",
    "MLFLOW_AUTH_ADMIN_PASSWORD": f"${{{AUTH_PASSWORD}:-}}",
}
# MLflow's auth configuration, its defaults but one: a user's password is checked once per 5
# minutes, not on every request (a PBKDF2 hash each: CPU seconds for a run's records on a loaded
# host, whose last ones then missed the PS's 15 s at its end). Its user store on the volume (the
# server's working directory); a password changed through MLflow's API holds within 5 minutes.
AUTH_CONFIG = (  # \\n: a new line, for printf
    "[mlflow]\\ndefault_permission = READ\\ndatabase_uri = sqlite:///basic_auth.db\\n"
    "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\\nauth_cache_ttl_seconds = 300\\n"
)
AUTH_ENTRYPOINT = [
    "/bin/sh",
    "-c",
    # `$$`: compose's `$`, for the shell
    f"printf '{AUTH_CONFIG}' > /tmp/basic_auth.ini && export MLFLOW_AUTH_CONFIG_PATH=/tmp/basic_auth.ini && "
    "export MLFLOW_FLASK_SERVER_SECRET_KEY=\"$$(python -c 'import secrets; print(secrets.token_hex(32))')\" && "
    'exec mlflow server --app-name basic-auth "$$@"',
    "mlflow-server",
]


def tracked_by_own_server(t: Topology) -> bool:
    """The job runs the project's own MLflow server: `tracking.mlflow`, and a PS to log to (a
    loaded topology cannot have the one without the other; a copy made in code is not checked)."""
    return t.tracking.mlflow and has_ps(t)


def refuse_own_server(t: Topology, target: str) -> None:
    """The project's own server is a compose service: other targets are told to name one."""
    if t.tracking.mlflow:
        raise UsageError(
            f"tracking.mlflow: got true; the project's own MLflow server runs with the compose target only, "
            f"not --target {target}: set tracking.mlflow to false and MLFLOW_TRACKING_URI to a tracking server of "
            "yours, which the PS then logs to"
        )


# MLflow's own variables for a secured server and an S3 artifact store: the PS alone gets them, by
# name, from the environment of the compose (or stack) call. A null value is compose's "from the
# caller; unset where the caller has not set it": no secret is written into a rendered file.
FROM_CALLER = (
    "MLFLOW_TRACKING_USERNAME",
    "MLFLOW_TRACKING_PASSWORD",
    "MLFLOW_TRACKING_TOKEN",
    "MLFLOW_TRACKING_INSECURE_TLS",
    "MLFLOW_S3_ENDPOINT_URL",
    "MLFLOW_S3_IGNORE_TLS",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_DEFAULT_REGION",
)
JOB_EXECUTION = "MLFLOW_SERVER_ENABLE_JOB_EXECUTION"


def mlflow_service(t: Topology, network: str, user: str) -> dict[str, Any]:
    """`mlflow server` on the project's network, its store on the volume, its UI published on
    127.0.0.1 only (like `make tensorboard`): one worker process, the runs in sqlite, artifacts
    (the exported model) served through it, so the PS needs nothing but its URI (and with
    tracking.auth, the caller's user and password)."""
    svc: dict[str, Any] = {
        "image": MLFLOW_IMAGE,
        "command": [
            "--backend-store-uri",
            f"sqlite:///{MLFLOW_DIR}/mlflow.db",
            "--artifacts-destination",
            f"{MLFLOW_DIR}/artifacts",
            "--host",
            "0.0.0.0",  # inside the container; the host side is 127.0.0.1 (ports)
            "--port",
            str(MLFLOW_CONTAINER_PORT),
            "--workers",
            "1",
            "--allowed-hosts",
            ALLOWED_HOSTS,
            "--uvicorn-opts",
            "--no-access-log",  # a line per request (the health probe's every 5 s) would bury the rest
        ],
        # MLflow 3's job runner (GenAI evaluation jobs, ~10 huey consumer processes and their store
        # in /dev/shm) serves nothing a training run logs: off.
        "environment": {JOB_EXECUTION: "false"},
        "labels": {LABEL_PROJECT: t.name, LABEL_ROLE: MLFLOW_SERVICE},
        "user": user,
        "init": True,
        "cap_drop": ["ALL"],
        "security_opt": ["no-new-privileges:true"],
        "networks": [network],
        "volumes": [{"type": "volume", "source": MLFLOW_VOLUME, "target": MLFLOW_DIR}],
        "ports": [f"127.0.0.1:${{{MLFLOW_PORT}:-{MLFLOW_CONTAINER_PORT}}}:{MLFLOW_CONTAINER_PORT}"],
        "healthcheck": {
            "test": ["CMD", "python", "-c", HEALTH_PROBE],
            "interval": "5s",
            "timeout": "40s",
            "retries": 30,
            "start_period": "30s",
        },
        # Up for the whole project: it outlives the run, so that its UI shows the finished run.
        "restart": "unless-stopped",
    }
    if t.tracking.auth:
        svc["entrypoint"] = AUTH_ENTRYPOINT
        svc["environment"].update(AUTH_ENVIRONMENT)
    return svc


def auth_refusal(t: Topology, environ: Mapping[str, str]) -> Optional[str]:
    """Why `up` cannot start the project's server with tracking.auth in `environ`; None if it can."""
    if not (t.tracking.auth and tracked_by_own_server(t)):
        return None
    password = environ.get(AUTH_PASSWORD, "")
    if len(password) >= AUTH_MIN_PASSWORD:
        return None
    got = "not set" if not password else f"{len(password)} characters"
    return (
        f"tracking.auth: got true; {AUTH_PASSWORD} is {got}: set it to the server's admin password "
        f"(at least {AUTH_MIN_PASSWORD} characters; the user: {AUTH_USER}, default {AUTH_DEFAULT_USER}) "
        "in the environment of `make up`"
    )


def ui_address(environ: Optional[Mapping[str, str]] = None) -> str:
    """Where the server's UI is on the host, for the port the compose call publishes it on."""
    port = (os.environ if environ is None else environ).get(MLFLOW_PORT) or MLFLOW_CONTAINER_PORT
    return f"http://127.0.0.1:{port}"


def mlflow_volume(t: Topology) -> dict[str, Any]:
    return {"labels": {LABEL_PROJECT: t.name}}


def track_in_own_server(ps: dict[str, Any], auth: bool = False) -> None:
    """The PS's service: MLflow's URI defaults to the project's server, and it starts once that
    server answers (its first record then lands); with `auth`, as the server's admin."""
    ps["environment"]["MLFLOW_TRACKING_URI"] = f"${{MLFLOW_TRACKING_URI:-{MLFLOW_URI}}}"
    if auth:  # the password stays a name, taken from the caller (FROM_CALLER)
        ps["environment"][AUTH_USER] = f"${{{AUTH_USER}:-{AUTH_DEFAULT_USER}}}"
    # The run's address in the PS's log, as the host reaches this server (app.training.tracking).
    ps["environment"][MLFLOW_SERVER_ENV] = MLFLOW_URI
    ps["environment"][MLFLOW_UI_ENV] = f"http://127.0.0.1:${{{MLFLOW_PORT}:-{MLFLOW_CONTAINER_PORT}}}"
    ps["depends_on"] = {**ps.get("depends_on", {}), MLFLOW_SERVICE: {"condition": "service_healthy"}}
