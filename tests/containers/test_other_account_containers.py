"""Another account on the host cannot run code in, write to or stall a compose run.

Docker routes the host to every address of a project's bridge, published or not, so a port the
PS listened on there would be open to every account. The run is real (cpu-smoke, PS + 2
workers, the image built from the current app code); while it trains, `nobody` (uid 65534,
set with setpriv) tries the PS's rendezvous port and every TCP port any container of the job
listens on, at each of its bridge addresses, and the `exchange` volume that holds the run's
secret and sockets on the host; a container on another network tries the same ports.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml

from orchestrator.backends.compose import adapter
from orchestrator.backends.registry import get
from orchestrator.paths import ROOT
from orchestrator.verbs import cluster as verbs

from needs import host_has

pytestmark = [pytest.mark.slow, pytest.mark.docker]
NOBODY = 65534
RENDEZVOUS_PORT = 29500

# Run as nobody: argv[1] the (address, port) pairs to try, argv[2] the volume's directory on the host.
ATTACK = r"""
import json, os, socket, sys
targets, volume = json.loads(sys.argv[1]), sys.argv[2]
said = {}
for host, port in targets:
    try:
        with socket.create_connection((host, port), timeout=5) as s:
            s.sendall(os.urandom(1 << 18))
        said[f"{host}:{port}"] = "connected"
    except OSError as error:
        said[f"{host}:{port}"] = type(error).__name__
if volume:
    try:
        os.listdir(volume)
        said["the exchange volume"] = "listed"
    except OSError as error:
        said["the exchange volume"] = type(error).__name__
print(json.dumps(said), flush=True)
"""


DOCKER_DNS = "0B00007F"  # 127.0.0.11 as /proc/net/tcp writes it: Docker's resolver in each container


def _listening(container) -> list[int]:
    """The TCP ports a process of `container` listens on (its network namespace's tables), but
    Docker's own resolver's, on 127.0.0.11 (reached only from inside that namespace)."""
    result = container.exec_run(["cat", "/proc/net/tcp", "/proc/net/tcp6"])
    assert result.exit_code == 0, result.output
    ports = set()
    for line in result.output.decode().splitlines():
        fields = line.split()
        if len(fields) > 3 and fields[3] == "0A" and not fields[1].startswith(f"{DOCKER_DNS}:"):  # LISTEN
            ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return sorted(ports)


def until(what: str, check, timeout: float = 300.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(1)
    pytest.fail(f"{what}: not within {timeout:.0f} s")


@host_has(os.geteuid() == 0 and shutil.which("setpriv") is not None, "root and setpriv, to act as another account")
def test_another_account_cannot_reach_or_stall_a_compose_run(engine, offline_image, tmp_path):
    project = f"psc-other-{uuid.uuid4().hex[:6]}"
    doc = yaml.safe_load((ROOT / "configs/cpu-smoke.yaml").read_text())
    doc["image"]["tag"], doc["train"]["epochs"] = offline_image, 8
    config = tmp_path / "topo.yaml"
    config.write_text(yaml.safe_dump(doc))
    try:
        out = io.StringIO()
        assert verbs.up(get("compose"), str(config), name=project, remember=False, out=out) == 0, out.getvalue()
        until(
            "worker2 trains",
            lambda: re.search(r"\| Epoch: 2 \|", adapter.log_text(engine, project, "worker2")),
        )
        running = [c for c in adapter.containers(engine, project) if c.status == "running"]
        assert {adapter.service_of(c) for c in running} >= {"ps", "worker1", "worker2"}
        listening = {adapter.service_of(c): _listening(c) for c in running}
        addresses = [
            n["IPAddress"] for c in running for n in c.attrs["NetworkSettings"]["Networks"].values() if n["IPAddress"]
        ]
        assert addresses, [c.attrs["NetworkSettings"] for c in running]
        targets = sorted({(a, p) for a in addresses for p in [RENDEZVOUS_PORT, *sum(listening.values(), [])]})
        volume = engine.volumes.get(f"{project}_exchange").attrs["Mountpoint"]
        attacker = subprocess.run(
            ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--"]
            + [sys.executable, "-c", ATTACK, json.dumps(targets), volume],
            capture_output=True,
            text=True,
            timeout=120,
            cwd="/",
        )
        assert attacker.returncode == 0, attacker.stderr
        said = json.loads(attacker.stdout)
        # ...and a container on Docker's default bridge, another network than the project's
        outside = engine.containers.run(
            offline_image,
            [json.dumps(targets), ""],
            entrypoint=["python", "-c", ATTACK],
            network="bridge",
            user="65534:65534",
            remove=True,
            stdout=True,
            stderr=True,
        )
        from_outside = json.loads(outside.decode().strip().splitlines()[-1])
        states = adapter.wait_exited(engine, project, len(adapter.containers(engine, project)), 400, io.StringIO())
        assert states is not None, "the run did not end within 400 s"
        codes = {s.service: s.exit_code for s in states}
        ps_log = adapter.log_text(engine, project, "ps")
    finally:
        verbs.down(get("compose"), str(config), name=project, volumes=True, out=io.StringIO())
    # No process of the job listens on a TCP port: the exchange is UNIX sockets on the volume.
    assert listening == {service: [] for service in listening}, listening
    assert Path(volume).is_absolute()
    assert said.pop("the exchange volume") == "PermissionError"
    assert set(said.values()) == {"ConnectionRefusedError"}, said
    assert set(from_outside) == {f"{a}:{p}" for a, p in targets}, from_outside
    assert "connected" not in from_outside.values(), from_outside  # refused, or dropped by Docker's isolation
    # ...and the job trained on, unstalled, to its usual accuracy.
    assert set(codes.values()) == {0}, codes
    final = re.findall(r"^Accuracy: ([0-9.]+)$", ps_log, re.M)
    assert final and float(final[-1]) >= 0.90, ps_log[-3000:]
