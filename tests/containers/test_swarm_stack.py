"""The cpu-smoke topology as a Docker Swarm stack on this engine (a single-node
swarm): `stack-smoke` deploys, judges every task's exit state and the PS's
`Accuracy:` line, and ends clean (stack removed, its containers, network and
volume gone). stack-up, stack-status, stack-logs and stack-down are tested on
the two-node swarm (test_swarm_nodes.py).

The swarm: used as it is when this engine is already a manager; otherwise the
tests `docker swarm init` one and `docker swarm leave --force` it at the end
(only then). Without an engine they skip, except under CI=true (they fail).
"""

import io
import re
import subprocess

import pytest
from engine_networks import alone_on_networks

from orchestrator.backends.registry import get
from orchestrator.backends.swarm import adapter as swarm_adapter
from orchestrator.paths import ROOT
from orchestrator.verbs import smoke as smoke_verb

pytestmark = [pytest.mark.slow, pytest.mark.docker]

CPU = ROOT / "configs" / "cpu-smoke.yaml"
GWBRIDGE = "docker_gwbridge"  # the bridge `docker swarm init` adds for tasks' outside traffic


def _init_swarm() -> None:
    r = subprocess.run(["docker", "swarm", "init"], capture_output=True, text=True, timeout=120)
    if r.returncode != 0 and "advertise" in r.stderr:  # several addresses: a one-node swarm needs none of them
        r = subprocess.run(
            ["docker", "swarm", "init", "--advertise-addr", "127.0.0.1"], capture_output=True, text=True, timeout=120
        )
    if r.returncode != 0:
        pytest.fail(f"docker swarm init failed: {r.stderr.strip()}", pytrace=False)


@pytest.fixture(scope="module")
def swarm(engine, offline_image):
    state = swarm_adapter.swarm_state(engine.info())
    created = state["state"] == "inactive"
    bridge_before = bool(engine.networks.list(names=[GWBRIDGE]))
    if created:
        _init_swarm()
    elif state["state"] != "active" or not state["manager"]:
        pytest.fail(f"this engine is in a swarm, but not as a working manager: {state}", pytrace=False)
    yield engine
    if created:
        with alone_on_networks():  # a leave drops the names of every bridge network of the moment
            subprocess.run(["docker", "swarm", "leave", "--force"], capture_output=True, timeout=120)
        if not bridge_before:  # `swarm init` made it; `leave` keeps it
            subprocess.run(["docker", "network", "rm", GWBRIDGE], capture_output=True, timeout=120)


def assert_gone(engine, stack: str) -> None:
    assert swarm_adapter.leftovers(engine, stack) == []
    assert engine.volumes.list(filters={"label": f"{swarm_adapter.LABEL_STACK}={stack}"}) == []


def test_stack_smoke(swarm):
    """`python -m orchestrator stack-smoke` (make stack-smoke): accuracy >= 0.90, every task complete with exit 0."""
    out = io.StringIO()
    status = smoke_verb.smoke(get("swarm"), str(CPU), 2, name="psc-test-stack-smoke", out=out)
    text = out.getvalue()
    print(text[-5000:])
    assert status == 0
    m = re.search(
        r"^stack-smoke: passed: Accuracy ([0-9.]+) >= 0.90; 3 tasks complete, exit 0, no retry", text, re.MULTILINE
    )
    assert m and float(m.group(1)) >= 0.90
    assert "warning: docker stack deploy" not in text  # Swarm ignored no key of the stack file
    assert_gone(swarm, "psc-test-stack-smoke")
