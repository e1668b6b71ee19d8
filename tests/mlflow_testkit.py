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
def serve(root: Path, host: str, port: int) -> Iterator[str]:
    """`mlflow server` on host:port with its store under `root`, until the block ends; its URI."""
    mlflow = shutil.which("mlflow", path=str(Path(sys.executable).parent))
    assert mlflow, "mlflow is in the dev venv (pyproject's dev extra)"
    argv = [mlflow, "server", "--backend-store-uri", f"sqlite:///{root}/store.db", "--workers", "1"]
    argv += ["--artifacts-destination", str(root / "artifacts"), "--host", host, "--port", str(port)]
    # As the project's own server runs (orchestrator/render/tracking.py): MLflow 3's job runner off,
    # its ~10 consumer processes and the store it leaves in /dev/shm with it.
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
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
