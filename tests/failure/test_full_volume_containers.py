"""A state volume that fills up, in containers (compose, the offline cpu-smoke image): a
tmpfs volume of 1 MB holds one checkpoint of the cnn (0.58 MB) and the metrics, not a second
file beside it. Before the fix the PS failed at the end (`final.pt not written`, exit 1) and
compose restarted it into a loop: resumed from the first checkpoint, waited for workers that
had finished, exited 1 again. Now it warns at the start, holds the trained model until
there is room (a user deletes the old checkpoint), writes final.pt and exits 0, never
restarted."""

from __future__ import annotations

import dataclasses
import io
import re

import pytest

from orchestrator import images
from orchestrator.chaos.common import RUN_TIMEOUT, chaos_topology, wait_until
from orchestrator.chaos.containers import ContainerJob
from orchestrator.topology.model import State

pytestmark = [pytest.mark.slow, pytest.mark.docker]
TMPFS_1M = {"type": "tmpfs", "device": "tmpfs", "o": "size=1m,uid=1000,gid=1000"}  # docker volume create -o


def test_a_full_state_volume_holds_the_model_until_there_is_room_then_ends_0(docker_engine, tmp_path):
    t = chaos_topology(workers=2)
    t = t.model_copy(
        update={
            "train": dataclasses.replace(t.train, epochs=10),
            "ps": dataclasses.replace(t.ps, checkpoint_every=20),
            "state": State(volume_driver="local", driver_opts=TMPFS_1M),
        }
    )
    base, pip_source = images.source(t, offline=True)
    images.build(t.image_tag, base, pip_source, out=io.StringIO())
    job = ContainerJob(t, "psc-full-volume")
    try:
        job.down(volumes=True)
        job.up()
        ps = job.containers()["ps"]
        wait_until("the PS holding its model", lambda: b"final.pt not written" in ps.logs(), RUN_TIMEOUT)
        assert job.states()["ps"]["status"] == "running"  # was: exited 1, restarted into a loop
        # Room made as a user would: the old checkpoint goes (a tmpfs volume lives only while mounted).
        ps.exec_run(["sh", "-c", "rm -f /state/checkpoints/ckpt-*.pt"])
        states = job.wait_done()
        log = ps.logs().decode("utf-8", "replace")
    finally:
        (tmp_path / "containers.log").write_text(job.logs(), encoding="utf-8")
        job.close()
    assert all(s.exit_code == 0 and s.restarts == 0 for s in states.values()), states
    assert "room for fewer than two checkpoints" in log  # said at the start
    held = re.search(r"the model trained to version (\d+) is kept in memory", log)
    saved = re.search(r"saved /state/checkpoints/final\.pt \(version (\d+)", log)
    assert held and saved and held.group(1) == saved.group(1), log[-3000:]
    assert "Accuracy:" in log
