"""Another account on the host cannot run code in, write to or stall a compose allreduce run.

The DDP ranks share the `pidns` holder's network namespace: the holder alone has an address on
the project's bridge, the ranks' rendezvous is a c10d FileStore on the `exchange` volume and
Gloo binds the loopback, so no TCP listener of the job is on the bridge (a TCPStore would listen
on every address). The run is real (cpu-smoke as 2 DDP workers, the image built from the current
app code); while it trains, `nobody` (uid 65534, set with setpriv) tries the old rendezvous port
and every TCP port the namespace listens on at the holder's bridge address, and the `exchange`
volume on the host; a container on Docker's default bridge tries the same ports.
"""

from __future__ import annotations

import io
import ipaddress
import json
import os
import re
import shutil
import subprocess
import sys
import uuid

import pytest
import yaml
from test_other_account_containers import ATTACK, NOBODY, RENDEZVOUS_PORT, until

from orchestrator.backends.compose import adapter
from orchestrator.backends.registry import get
from orchestrator.paths import ROOT
from orchestrator.topology.services import PIDNS_SERVICE
from orchestrator.verbs import cluster as verbs

from needs import host_has

pytestmark = [pytest.mark.slow, pytest.mark.docker]
DOCKER_DNS = ipaddress.ip_address("127.0.0.11")  # Docker's resolver, inside the namespace only


def listeners(container) -> set[tuple[str, int]]:
    """(address, port) of every TCP listener in `container`'s network namespace."""
    result = container.exec_run(["cat", "/proc/net/tcp", "/proc/net/tcp6"])
    assert result.exit_code == 0, result.output
    found = set()
    for line in result.output.decode().splitlines():
        fields = line.split()
        if len(fields) > 3 and fields[3] == "0A":  # LISTEN
            address, port = fields[1].rsplit(":", 1)
            raw = bytes.fromhex(address)
            ip = ipaddress.ip_address(b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4)))
            if ip != DOCKER_DNS:
                found.add((str(ip), int(port, 16)))
    return found


@host_has(os.geteuid() == 0 and shutil.which("setpriv") is not None, "root and setpriv, to act as another account")
def test_another_account_cannot_reach_or_stall_a_compose_allreduce_run(engine, offline_image, tmp_path):
    project = f"psc-other-ddp-{uuid.uuid4().hex[:6]}"
    doc = yaml.safe_load((ROOT / "configs/cpu-smoke.yaml").read_text())
    doc["image"]["tag"], doc["train"]["epochs"] = offline_image, 8
    config = tmp_path / "topo.yaml"
    config.write_text(yaml.safe_dump(doc))
    kw = dict(name=project, strategy="allreduce")
    try:
        out = io.StringIO()
        assert verbs.up(get("compose"), str(config), remember=False, out=out, **kw) == 0, out.getvalue()
        until("worker2 trains", lambda: re.search(r"\| Epoch: 2 \|", adapter.log_text(engine, project, "worker2")))
        running = {adapter.service_of(c): c for c in adapter.containers(engine, project) if c.status == "running"}
        assert set(running) >= {PIDNS_SERVICE, "worker1", "worker2"}, running
        listening = {name: listeners(c) for name, c in running.items()}
        own = {
            name: [n["IPAddress"] for n in c.attrs["NetworkSettings"]["Networks"].values()]
            for name, c in running.items()
        }
        addresses = [a for a in own[PIDNS_SERVICE] if a]
        assert addresses, own
        ports = {port for found in listening.values() for _, port in found}
        targets = sorted({(a, p) for a in addresses for p in [RENDEZVOUS_PORT, *ports]})
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
        states = adapter.wait_exited(engine, project, 3, 400, io.StringIO())
        assert states is not None, "the run did not end within 400 s"
        codes = {s.service: s.exit_code for s in states}
        logs = {name: adapter.log_text(engine, project, name) for name in ("worker1", "worker2")}
    finally:
        verbs.down(get("compose"), str(config), volumes=True, out=io.StringIO(), **kw)
    # One namespace: every rank sees the holder's listeners; the ranks have no address of their own.
    assert listening["worker1"] == listening["worker2"] == listening[PIDNS_SERVICE], listening
    assert own["worker1"] == own["worker2"] == [], own
    # Gloo's listeners, on the loopback alone: nothing on the bridge, no TCPStore (it binds every address).
    assert listening["worker1"] and all(ipaddress.ip_address(a).is_loopback for a, _ in listening["worker1"]), listening
    assert said.pop("the exchange volume") == "PermissionError"
    assert set(said.values()) == {"ConnectionRefusedError"}, said
    assert set(from_outside) == {f"{a}:{p}" for a, p in targets}, from_outside
    assert "connected" not in from_outside.values(), from_outside  # refused, or dropped by Docker's isolation
    # ...and the job trained on, unstalled, to its usual accuracy.
    assert set(codes.values()) == {0}, codes
    assert "joined the allreduce job at files in /run/psc" in logs["worker2"], logs["worker2"][-3000:]
    final = re.findall(r"^Accuracy: ([0-9.]+)$", logs["worker1"], re.M)
    assert final and float(final[-1]) >= 0.90, logs["worker1"][-3000:]
