"""The swarm chaos row without its two-node swarm: skipped, one line saying what it needs."""

import io

from orchestrator.chaos import registry, swarm


def test_node_loss_row_without_the_two_node_swarm_is_skipped_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setitem(swarm.SOCKETS, swarm.MANAGER, f"unix://{tmp_path}/no-such.sock")
    out = io.StringIO()
    assert registry.run(["swarm-node-loss"], tmp_path, containers=True, out=out) == 0
    lines = out.getvalue().splitlines()
    said = [line for line in lines if "skipped:" in line]
    assert said == [
        f"    skipped: needs the two-node swarm (sudo tests/containers/swarm_nodes.sh up IMAGE): "
        f"no unix://{tmp_path}/no-such.sock"
    ], lines
    row = next(line for line in lines if line.startswith("node psc-n2 cut off"))
    assert row.split("  ")[1].strip() == "skipped"
