"""The cpu-smoke topology on a real two-node swarm on this host (`two_nodes`:
tests/containers/swarm_nodes.sh, psc-n1 the manager and psc-n2, each a dockerd
in a network namespace of its own): RPC across nodes over the overlay network,
placement from the topology, the image on both nodes, and node 2 cut off
mid-run (the `swarm-node-loss` chaos row).

Two stack runs in all: the placement run also covers stack-up, stack-status,
stack-logs and stack-down with DOCKER_HOST naming node 1.
"""

import io
import re
import time

import pytest

from orchestrator import paths
from orchestrator.backends import smoke
from orchestrator.backends.registry import get
from orchestrator.backends.swarm import adapter as swarm_adapter
from orchestrator.chaos import swarm as chaos_swarm
from orchestrator.paths import ROOT
from orchestrator.verbs import cluster as verbs
from orchestrator.verbs.smoke import finished

# The first test also waits for the two-node setup: seconds when the image links in, minutes when it must be loaded.
# In the engine group beside `engine` (tests/conftest.py): its swarm is two engines of its own.
pytestmark = [pytest.mark.slow, pytest.mark.docker, pytest.mark.timeout(1200), pytest.mark.xdist_group("engine-2")]

CPU = ROOT / "configs" / "cpu-smoke.yaml"
N1, N2 = chaos_swarm.MANAGER, chaos_swarm.LOST


def test_stack_trains_across_nodes_with_the_ps_placed_on_node2(two_nodes, tmp_path, monkeypatch, capfd):
    """`swarm: {ps: psc-n2, workers: [psc-n1]}`: the PS runs on node 2 (not the manager), both
    workers on node 1, so every push crosses nodes; the PS reaches the threshold; stack-status,
    stack-logs and stack-down work against the manager named by DOCKER_HOST."""
    monkeypatch.setenv("DOCKER_HOST", chaos_swarm.SOCKETS[N1])  # the verbs and their docker CLI calls go to node 1
    monkeypatch.setattr(paths, "RUNS", tmp_path)  # nothing of the user's runs/ is touched
    stack = "psc-nodes-placed"
    config = tmp_path / "t.yaml"
    config.write_text(
        CPU.read_text()
        .replace("name: cpu-smoke", f"name: {stack}")
        .replace("  device: cpu", f"  device: cpu\n  tag: {two_nodes}")
        + f"\nswarm:\n  ps: {N2}\n  workers: [{N1}]\n"
    )
    start = time.monotonic()
    try:
        out = io.StringIO()
        assert verbs.up(get("swarm"), str(config), 2, out=out) == 0, out.getvalue()
        assert re.search(
            r"^==> doctor: \d+ checks passed \(python -m orchestrator doctor --target swarm lists them\)",
            out.getvalue(),
            re.MULTILINE,
        )
        assert (tmp_path / stack / "stack.yaml").is_file() and (tmp_path / "stack.json").is_file()
        client = chaos_swarm.node_client(N1)
        swarm = verbs.resolve(get("swarm"), None, None)  # the last stack-up, from the record
        states = smoke.wait(
            lambda: get("swarm").describe(swarm),
            finished(["ps", "worker1", "worker2"]),
            300,
            io.StringIO(),
            settle=True,
        )
        assert states is not None, "the stack's tasks did not end within 300 s"
        capfd.readouterr()

        tasks = chaos_swarm.Stack(stack).tasks()
        print("\n".join(f"    {t['service']:<8} {t['node']:<7} {t['state']}" for t in tasks))
        assert {(t["service"], t["node"]) for t in tasks} == {("ps", N2), ("worker1", N1), ("worker2", N1)}

        out = io.StringIO()
        assert verbs.status(get("swarm"), out=out) == 0  # the last stack-up, from the record
        rows = [line.split() for line in out.getvalue().splitlines()[2:]]
        assert rows == [[s, "complete", "0", "0"] for s in ("ps", "worker1", "worker2")], out.getvalue()

        assert verbs.logs(get("swarm"), follow=False) == 0
        captured = capfd.readouterr()
        logs, diagnostics = captured.out, captured.out + captured.err  # the services' stdout, and both
        assert re.search(
            rf"^{stack}_worker2\.1@{N1}\s+\| worker2 \| Epoch: \d+ \| Batch: \d+ \| Loss: ", logs, re.MULTILINE
        ), logs[-3000:]
        accuracy = re.findall(rf"^{stack}_ps\.1@{N2}\s+\| Accuracy: ([0-9.]+)$", logs, re.MULTILINE)
        assert accuracy and float(accuracy[-1]) >= 0.90, logs[-3000:]
        # across nodes the exchange is the job's sockets (TCP, CURVE): the PS makes no shared-memory segment
        said = rf"^{stack}_ps\.1@{N2}\s+\| .* ps: exchange over the job's transport \("
        assert re.search(said, diagnostics, re.MULTILINE), diagnostics[-3000:]
        assert "through shared memory" not in diagnostics
        print(
            f"placement run: PS on {N2}, workers on {N1}, accuracy {accuracy[-1]}, "
            f"{time.monotonic() - start:.0f} s from stack-up to the end"
        )

        out = io.StringIO()
        assert verbs.down(get("swarm"), out=out) == 0
        assert swarm_adapter.leftovers(client, stack) == []
        n2, label = chaos_swarm.node_client(N2), {"label": f"{swarm_adapter.LABEL_STACK}={stack}"}
        assert n2.containers.list(all=True, filters=label) == [] and n2.networks.list(filters=label) == []
        chaos_swarm.node_client(N2).volumes.get(f"{stack}_state")  # kept on the PS's node
    finally:
        verbs.down(get("swarm"), name=stack, volumes=True, out=io.StringIO())


def test_node2_cut_off_mid_run_the_run_recovers(two_nodes, tmp_path):
    """The `swarm-node-loss` chaos row: node 2's link down for longer than the RPC timeout
    while workers train there; Swarm starts them again on node 1, they rejoin the PS, the
    PS exits 0 at the threshold, and afterwards no task is running, failing or restarting."""
    outcome = chaos_swarm.node_loss(tmp_path)
    d = outcome.details
    print(f"node loss: {outcome.notes}")
    print(
        f"node loss: placement {d.get('placement')}; PS dropped the first lost worker "
        f"{outcome.detected_s} s after the cut; rescheduled on {N1} after {d.get('reschedule_s')} s; "
        f"rejoined the PS after {d.get('rejoin_s')} s; link down {d.get('cut_s')} s; {N2} ready "
        f"{d.get('node_back_s')} s after the link came back; final accuracy {outcome.accuracy}; "
        f"run {d.get('run_s')} s"
    )
    for t in d.get("tasks", []):
        print(f"    {t['service']:<8} {t['node']:<7} {t['state']:<9} desired {t['desired']:<8} exit {t['exit']}")
    assert not outcome.skipped, outcome.notes
    assert outcome.recovered, (
        f"{outcome.notes}; logs in {tmp_path}/stack.log:\n" + (tmp_path / "stack.log").read_text()[-4000:]
    )
    assert outcome.accuracy is not None and outcome.accuracy >= 0.90
    assert d["cut_s"] > chaos_swarm.node_loss_topology().ps.rpc_timeout
    newest = {t["service"]: t for t in d["tasks"]}
    assert newest["ps"]["node"] == N1 and newest["ps"]["state"] == "complete"
    assert all(t["state"] not in chaos_swarm.ACTIVE for t in d["tasks"])
