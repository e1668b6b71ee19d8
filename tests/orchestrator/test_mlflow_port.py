"""The project's own MLflow server's host port (PSC_MLFLOW_PORT): `doctor` checks it, naming
what holds it, and lets this project's own server hold it (a run already up); `up` refuses a
port something else holds in one line, exit 2, before it creates anything (before: compose
failed with exit 1 and left `pidns` running beside 4 created containers)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator import paths
from orchestrator.backends.compose import doctor as compose_doctor
from orchestrator.doctor.facts import Facts
from orchestrator.topology.model import parse

import doctor_kit as d
from needs import unavailable
from orch_helpers import REPO

TRACKED = (REPO / "configs/cpu-smoke.yaml").read_text() + "tracking: {mlflow: true}\n"
LISTENER = (
    "import socket, sys; s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(); "
    "print(s.getsockname()[1], flush=True); sys.stdin.read()"
)


def check(holder: object, port: object = 5001, text: str = TRACKED) -> d.Check:
    t = parse(text, "t.yaml")
    return compose_doctor.check_mlflow_port(t, Facts(target={"mlflow_port": port, "mlflow_port_holder": holder}))


def test_a_free_port_and_this_projects_own_server_pass() -> None:
    assert check(None).ok is True
    own = check({"container": "cpu-smoke-mlflow-1", "project": "cpu-smoke", "service": "mlflow"})
    assert own.ok is True and "this project's own MLflow server (cpu-smoke-mlflow-1)" in own.text


def test_another_holder_is_named() -> None:
    other = check({"container": "b-mlflow-1", "project": "b", "service": "mlflow"})
    assert other.ok is False
    assert other.text == (
        "PSC_MLFLOW_PORT 5001 (the project's MLflow server, on 127.0.0.1) is already taken by "
        "container b-mlflow-1 (service mlflow of compose project b)"
    )
    assert "PSC_MLFLOW_PORT to a free port" in other.fix
    assert check({"container": "web", "project": "", "service": ""}).text.endswith("taken by container web")
    assert check({"process": "pid 7 (nginx)"}).text.endswith("taken by pid 7 (nginx)")
    assert check({"process": ""}).text.endswith("a process of another user, or outside this PID namespace")
    assert check(None, port="http").ok is False


def test_not_needed_without_the_projects_own_server() -> None:
    c = check({"process": "pid 7 (nginx)"}, text=(REPO / "configs/cpu-smoke.yaml").read_text())
    assert c.ok is True and "not needed" in c.text


def test_the_container_publishing_the_port_is_found() -> None:
    listed = [
        {"Names": ["/a-ps-1"], "Labels": {}, "Ports": [{"PrivatePort": 29500, "Type": "tcp"}]},
        {
            "Names": ["/b-mlflow-1"],
            "Labels": {"com.docker.compose.project": "b", "com.docker.compose.service": "mlflow"},
            "Ports": [{"IP": "127.0.0.1", "PrivatePort": 5000, "PublicPort": 5001, "Type": "tcp"}],
        },
    ]
    assert compose_doctor.published_on(listed, 5001) == {"container": "b-mlflow-1", "project": "b", "service": "mlflow"}
    assert compose_doctor.published_on(listed, 5000) is None


@pytest.fixture
def held_port():
    """A port a real process of this user listens on, 127.0.0.1, until the test ends."""
    p = subprocess.Popen([sys.executable, "-c", LISTENER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None
        yield int(p.stdout.readline()), p.pid
    finally:
        p.kill()
        p.wait(timeout=30)


def test_the_process_holding_the_port_is_named(held_port: tuple[int, int]) -> None:
    port, pid = held_port
    found = compose_doctor.mlflow_facts(None, {"PSC_MLFLOW_PORT": str(port)})
    assert found == {"mlflow_port": port, "mlflow_port_holder": {"process": f"pid {pid} (python)"}}


@pytest.mark.slow
@pytest.mark.docker
def test_up_refuses_a_taken_port_and_creates_nothing(tmp_path: Path, held_port: tuple[int, int]) -> None:
    import docker

    try:
        client = docker.from_env(timeout=30)
        client.ping()
    except docker.errors.DockerException as e:
        unavailable(f"no Docker engine answers: {e}")
    port, pid = held_port
    name = "mlflow-port-taken"
    config = tmp_path / "t.yaml"
    config.write_text(TRACKED)
    env = {**os.environ, "PSC_MLFLOW_PORT": str(port)}
    cmd = [sys.executable, "-m", "orchestrator", "up", "-c", str(config), "--name", name]
    try:
        p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    finally:
        shutil.rmtree(paths.RUNS / name, ignore_errors=True)  # its up.lock (orchestrator.run_lock.starting)
    assert p.returncode == 2, p.stdout + p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and f"PSC_MLFLOW_PORT {port}" in lines[0] and f"pid {pid} (python)" in lines[0], lines
    assert "nothing was started" in lines[0]
    labelled = {"label": f"com.docker.compose.project={name}"}
    assert client.containers.list(all=True, filters=labelled) == []
    assert client.networks.list(filters=labelled) == [] and client.volumes.list(filters=labelled) == []
    with socket.socket() as s:  # the holder is untouched
        assert s.connect_ex(("127.0.0.1", port)) == 0
