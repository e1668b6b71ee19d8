"""network.same_host_copy on a real engine: a whole cpu-smoke run in containers exchanges
through the PS's shared memory (the holder's IPC namespace) and ends with every container, the
`pidns` holder included, exited 0."""

from __future__ import annotations

import io
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import yaml

from orchestrator.backends.compose import adapter
from orchestrator.paths import ROOT
from orchestrator.render import compose
from orchestrator.render.yamlio import write_atomic
from orchestrator.topology.model import parse
from orchestrator.topology.services import PIDNS_SERVICE, service_names

pytestmark = [pytest.mark.slow, pytest.mark.docker]


def _topology(project: str, image: str, **network) -> object:
    doc = yaml.safe_load((ROOT / "configs/cpu-smoke.yaml").read_text())
    doc["name"], doc["image"]["tag"] = project, image
    doc["network"] = {**doc.get("network", {}), **network}
    return parse(yaml.safe_dump(doc))


def _compose(project: str, doc: dict, tmp_path: Path, *args: str, check: bool = True) -> str:
    file = tmp_path / "compose.yaml"
    write_atomic(str(file), yaml.safe_dump(doc))
    argv = adapter.base_argv(adapter.detect(), adapter.Project(project, str(file), str(ROOT))) + list(args)
    r = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    if check and r.returncode != 0:
        pytest.fail(f"{' '.join(args)} failed: {r.stderr[-2000:]}")
    return r.stdout + r.stderr


def _exited(engine, project: str, service: str, timeout: float) -> int | None:
    """The exit code of `service`'s container once it has exited; None at the timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for c in adapter.containers(engine, project):
            c.reload()
            if adapter.service_of(c) == service and c.attrs["State"]["Status"] in ("exited", "dead"):
                return c.attrs["State"]["ExitCode"]
        time.sleep(1)
    return None


def test_a_finished_run_ends_with_every_container_and_the_holder_exited_0(engine, offline_image, tmp_path):
    project = f"psc-pidns-{uuid.uuid4().hex[:8]}"
    t = _topology(project, offline_image)
    doc = compose.render(t)
    assert PIDNS_SERVICE in doc["services"]
    try:
        _compose(project, doc, tmp_path, "up", "-d", "--no-build")
        expected = [PIDNS_SERVICE, *service_names(t)]
        states = adapter.wait_exited(engine, project, len(expected), 300, io.StringIO())
        assert states is not None, "the run did not end within 300 s"
        assert {s.service: s.exit_code for s in states} == dict.fromkeys(expected, 0)
        assert "every process of the job left" in adapter.log_text(engine, project, PIDNS_SERVICE)
        # the exchange went through the PS's shared memory, in the holder's /dev/shm
        assert "ps: exchange through shared memory /dev/shm/psc-" in adapter.log_text(engine, project, "ps")
        for worker in ("worker1", "worker2"):
            said = adapter.log_text(engine, project, worker)
            assert f"{worker}: exchange with ps through shared memory (/dev/shm/psc-" in said, said[-2000:]
    finally:
        _compose(project, doc, tmp_path, "down", "-v", "--remove-orphans", "-t", "1", check=False)
