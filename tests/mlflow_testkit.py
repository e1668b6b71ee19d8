"""A real `mlflow server` (sqlite store, artifacts beside it) for the tests of the PS's MLflow
tracking: from the dev venv, on a host address of the caller's choice."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

START_SECONDS = 180  # ~10 s on an idle 2-core CPU VM; minutes when it is loaded


@contextlib.contextmanager
def serve(root: Path, host: str, port: int, admin: tuple[str, str] | None = None) -> Iterator[str]:
    """`mlflow server` on host:port with its store under `root`, until the block ends; its URI.
    With `admin` (user, password): MLflow's basic auth (`--app-name basic-auth`), that user its
    admin, every other request refused."""
    mlflow = shutil.which("mlflow", path=str(Path(sys.executable).parent))
    assert mlflow, "mlflow is in the dev venv (pyproject's dev extra)"
    argv = [mlflow, "server", "--backend-store-uri", f"sqlite:///{root}/store.db", "--workers", "1"]
    argv += ["--artifacts-destination", str(root / "artifacts"), "--host", host, "--port", str(port)]
    # As the project's own server runs (orchestrator/render/tracking.py): MLflow 3's job runner off,
    # its ~10 consumer processes and the store it leaves in /dev/shm with it.
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    root.mkdir(parents=True, exist_ok=True)
    if admin is not None:
        (root / "basic_auth.ini").write_text(
            "[mlflow]\ndefault_permission = NO_PERMISSIONS\n"
            f"database_uri = sqlite:///{root}/auth.db\nadmin_username = {admin[0]}\nadmin_password = {admin[1]}\n"
            "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
        )
        argv += ["--app-name", "basic-auth"]
        env.update(
            MLFLOW_AUTH_CONFIG_PATH=str(root / "basic_auth.ini"), MLFLOW_FLASK_SERVER_SECRET_KEY=os.urandom(16).hex()
        )
    shm_before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    with open(root / "server.log", "w") as log:
        server = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
    uri = f"http://{host}:{port}"
    deadline = time.monotonic() + START_SECONDS
    try:
        while True:
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=2) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                pass
            assert server.poll() is None, (root / "server.log").read_text()[-2000:]
            assert time.monotonic() < deadline, f"mlflow server not up in {START_SECONDS} s"
            time.sleep(1)
        yield uri
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
        left = set(os.listdir("/dev/shm")) - shm_before if os.path.isdir("/dev/shm") else set()
        assert not [n for n in left if n.startswith("tmp")], f"the mlflow server left {sorted(left)} in /dev/shm"
