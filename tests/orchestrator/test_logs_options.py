"""`logs --timestamps/--tail N/--since X`: compose's flags, checked on the command line and
passed to `docker compose logs` and `docker service logs` (the real compose, on a project of
the offline base image: no build)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.backends.base import EVERY_LINE, Cluster, LogOptions
from orchestrator.backends.compose import adapter as compose_adapter
from orchestrator.backends.swarm import adapter as swarm_adapter

from needs import unavailable
from orch_helpers import REPO

V2 = compose_adapter.Compose(("docker", "compose"), 2)
P = compose_adapter.Project("cpu-smoke", "runs/cpu-smoke/compose.yaml", "/repo")


def test_the_options_are_composes_flags_after_logs() -> None:
    opts = LogOptions(timestamps=True, tail="20", since="42m")
    argv = compose_adapter.logs_argv(V2, P, follow=False, color=False, extra=opts.flags())
    assert argv[argv.index("logs") :] == ["logs", "--timestamps", "--tail", "20", "--since", "42m", "--no-color"]
    assert EVERY_LINE.flags() == []


def test_swarm_passes_them_to_docker_service_logs() -> None:
    argv = swarm_adapter.logs_argv("s", "ps", follow=True, extra=LogOptions(tail="all", since="2026-12-02").flags())
    assert argv == [
        "docker",
        "service",
        "logs",
        "--no-task-ids",
        "-f",
        "--tail",
        "all",
        "--since",
        "2026-12-02",
        "s_ps",
    ]


@pytest.mark.parametrize(
    ("flag", "value", "allowed"),
    [("--tail", "ten", "a whole number >= 0 or 'all'"), ("--since", "yesterday", "a duration back from now")],
)
def test_a_bad_value_is_one_line_naming_the_flag_the_value_and_what_is_allowed(
    flag: str, value: str, allowed: str
) -> None:
    p = subprocess.run(
        [sys.executable, "-m", "orchestrator", "logs", flag, value], cwd=REPO, capture_output=True, text=True
    )
    assert p.returncode == 2
    assert len(p.stderr.splitlines()) == 1, p.stderr
    assert flag in p.stderr and repr(value) in p.stderr and allowed in p.stderr, p.stderr


@pytest.mark.parametrize("since", ["42m", "1h30m", "2.5h", "1733140800", "2026-12-02T13:00:00Z", "2026-12-02"])
def test_since_takes_what_compose_takes(since: str) -> None:
    from orchestrator.arguments import log_since

    assert log_since(since) == since


BASE_IMAGE = "ps-compose-base:bookworm"


@pytest.mark.slow
@pytest.mark.docker
def test_compose_gives_the_last_line_with_its_timestamp(tmp_path: Path) -> None:
    import docker

    try:
        docker.from_env().images.get(BASE_IMAGE)
    except Exception as e:  # noqa: BLE001 - no engine, or no base image: the test cannot run here
        unavailable(f"no Docker engine or no {BASE_IMAGE} image: {e}")
    from orchestrator.backends.compose.backend import BACKEND, _compose

    name = f"psc-logs-{tmp_path.name[-12:].lower().replace('_', '-')}"
    name = re.sub(r"[^a-z0-9-]", "", name)
    file = tmp_path / "compose.yaml"
    file.write_text(
        f"services:\n  say:\n    image: {BASE_IMAGE}\n    command: [sh, -c, 'echo one; echo two; echo three']\n"
    )
    c = Cluster(name, file)
    base = [*_compose().prefix, "-p", name, "-f", str(file)]
    subprocess.run([*base, "up", "--no-build"], check=True, capture_output=True)
    try:
        lines = BACKEND.log_iter(c, follow=False, options=LogOptions(timestamps=True, tail="1"))
        got = [line for line in lines if line.strip()]
        # one line, the last; compose puts the engine's RFC 3339 time after the service's prefix
        assert len(got) == 1, got
        assert re.search(r"\| \d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d+Z three$", got[0].rstrip()), got
    finally:
        subprocess.run([*base, "down", "-v", "--remove-orphans"], check=True, capture_output=True)
