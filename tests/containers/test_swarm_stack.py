"""The cpu-smoke topology as a Docker Swarm stack on this engine (a single-node
swarm): deploy, every task's exit state, the PS's `Accuracy:` line, and a clean
end (stack removed, its containers, network and volume gone).

The swarm: used as it is when this engine is already a manager; otherwise the
tests `docker swarm init` one and `docker swarm leave --force` it at the end
(only then). Without an engine they skip, except under CI=true (they fail).
"""

import io
import re
import subprocess
from orchestrator.backends.swarm import adapter as swarm_adapter, verbs as swarm_verbs
from orchestrator.paths import ROOT

import pytest


pytestmark = [pytest.mark.slow, pytest.mark.docker]

CPU = ROOT / "configs" / "cpu-smoke.yaml"
GWBRIDGE = "docker_gwbridge"  # the bridge `docker swarm init` adds for tasks' outside traffic


def _init_swarm() -> None:
    r = subprocess.run(["docker", "swarm", "init"], capture_output=True, text=True, timeout=120)
    if r.returncode != 0 and "advertise" in r.stderr:  # several addresses: a one-node swarm needs none of them
        r = subprocess.run(["docker", "swarm", "init", "--advertise-addr", "127.0.0.1"],
                           capture_output=True, text=True, timeout=120)
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
        subprocess.run(["docker", "swarm", "leave", "--force"], capture_output=True, timeout=120)
        if not bridge_before:  # `swarm init` made it; `leave` keeps it
            subprocess.run(["docker", "network", "rm", GWBRIDGE], capture_output=True, timeout=120)


def assert_gone(engine, stack: str) -> None:
    assert swarm_adapter.leftovers(engine, stack) == []
    assert engine.volumes.list(filters={"label": f"{swarm_adapter.LABEL_STACK}={stack}"}) == []


def test_stack_smoke(swarm):
    """`python -m orchestrator stack-smoke` (make stack-smoke): accuracy >= 0.90, every task complete with exit 0."""
    out = io.StringIO()
    status = swarm_verbs.stack_smoke(str(CPU), 2, stack="psc-test-stack-smoke", out=out)
    text = out.getvalue()
    print(text[-5000:])
    assert status == 0
    m = re.search(r"^stack-smoke: passed: Accuracy ([0-9.]+) >= 0.90; 3 tasks complete, exit 0, no retry", text,
                  re.MULTILINE)
    assert m and float(m.group(1)) >= 0.90
    assert "warning: docker stack deploy" not in text  # Swarm ignored no key of the stack file
    assert_gone(swarm, "psc-test-stack-smoke")


def test_stack_up_status_logs_down(swarm, tmp_path, monkeypatch, capfd):
    monkeypatch.setattr(swarm_verbs, "RUNS", tmp_path)  # nothing of the user's runs/ is touched
    monkeypatch.setattr(swarm_verbs, "RECORD", tmp_path / "stack.json")
    stack = "psc-test-stack"
    config = tmp_path / "t.yaml"  # cpu-smoke under a stack name of its own, on the same image
    config.write_text(CPU.read_text().replace("name: cpu-smoke", f"name: {stack}")
                      .replace("  device: cpu", "  device: cpu\n  tag: ps-compose-cpu-smoke:latest"))
    swarm_verbs.stack_down(stack=stack, volumes=True, out=io.StringIO())
    try:
        out = io.StringIO()
        assert swarm_verbs.stack_up(str(config), 3, out=out) == 0
        assert "==> doctor: 10 checks passed (target swarm)" in out.getvalue()
        assert (tmp_path / stack / "stack.yaml").is_file() and (tmp_path / "stack.json").is_file()

        states = swarm_verbs.wait_done(swarm, stack, ["ps", "worker1", "worker2", "worker3"], 300, io.StringIO())
        assert states is not None, "the stack's tasks did not end within 300 s"
        capfd.readouterr()

        out = io.StringIO()
        assert swarm_verbs.stack_status(out=out) == 0  # the last stack-up, from runs/stack.json
        rows = [line.split() for line in out.getvalue().splitlines()[2:]]
        assert rows == [[s, "complete", "0", "0"] for s in ("ps", "worker1", "worker2", "worker3")], out.getvalue()

        assert swarm_verbs.stack_logs(follow=False) == 0
        logs = capfd.readouterr().out
        assert re.search(rf"^{stack}_worker3\.1@\S+\s+\| worker3 \| Epoch: \d+ \| Batch: \d+ \| Loss: ", logs,
                         re.MULTILINE), logs[-3000:]
        m = re.findall(rf"^{stack}_ps\.1@\S+\s+\| Accuracy: ([0-9.]+)$", logs, re.MULTILINE)
        assert m and float(m[-1]) >= 0.90, logs[-3000:]

        out = io.StringIO()
        assert swarm_verbs.stack_down(out=out) == 0
        assert swarm_adapter.leftovers(swarm, stack) == []
        swarm.volumes.get(f"{stack}_state")  # kept: checkpoints and metrics survive stack-down
    finally:
        swarm_verbs.stack_down(stack=stack, volumes=True, out=io.StringIO())
    assert_gone(swarm, stack)
