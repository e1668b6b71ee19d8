"""Faults as processes on 127.0.0.1 (the scenarios of `make chaos`, orchestrator/chaos/):
a killed worker, a killed PS, a killed PS shard, kills during checkpoint writes, a rank
started twice."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.backends.target_run import TargetRun
from orchestrator.chaos import checkpoints as chaos_checkpoints
from orchestrator.chaos import common as chaos_common
from orchestrator.chaos import processes as chaos_processes
from orchestrator.paths import ROOT

pytestmark = pytest.mark.slow


def _starts(runs_dir: Path, name: str) -> list[str]:
    """What process `name` wrote, one text per start of it: its lines in the launcher's log
    (runs_dir/cpu-smoke/local.log, each prefixed by its name), cut where the launcher says it ended."""
    starts, lines = [], []
    for line in (runs_dir / "cpu-smoke" / "local.log").read_text(errors="replace").splitlines():
        found = re.match(rf"{re.escape(name)} +\| (.*)$", line)
        if not found:
            continue
        if re.match(r"(exited with code|stopped \(code) ", found.group(1)):
            starts.append("\n".join(lines))
            lines = []
        else:
            lines.append(found.group(1))
    return starts + (["\n".join(lines)] if lines else [])


def _explain(out: chaos_common.Outcome, runs_dir: Path, lines: int = 40) -> str:
    """The outcome whole (pytest shortens an object's repr), then the launcher's last log lines."""
    log = runs_dir / "cpu-smoke" / "local.log"
    tail = log.read_text(errors="replace").splitlines()[-lines:] if log.exists() else ["(no log)"]
    return "\n".join([repr(out), f"--- {log}", *tail])


def test_a_killed_worker_is_dropped_and_its_restart_rejoins_and_pushes(tmp_path):
    out = chaos_processes.worker_kill(tmp_path)
    print(f"worker killed: dropped after {out.detected_s:.1f} s")

    assert out.recovered, _explain(out, tmp_path)
    assert out.accuracy >= 0.90
    assert out.details["exit_codes"] == {"ps": 0, "worker1": 0, "worker2": 0, "worker3": 0}
    # A bound that is the behaviour: the PS drops a dead worker within its RPC timeout
    # (chaos_topology: 10 s) instead of waiting on it; + 5 s for a loaded host.
    # Measured 1.1 s on a 2-core CPU VM (docs/testing.md lists these bounds).
    assert out.details["drop"]["worker"] == "worker2" and out.detected_s < 10 + 5
    assert out.details["rejoin"]["worker"] == "worker2_r2" and out.details["rejoin"]["epoch"] >= 5
    assert out.details["pushes_after_rejoin"] > 0
    ps_log = _starts(tmp_path, "ps")[0]
    assert len(re.findall(r"WARNING app.ps: dropped worker2 \(rank 2\): ", ps_log)) == 1, ps_log
    assert "worker2_r2 (rank 2) joined at version" in ps_log


def test_a_killed_ps_makes_workers_exit_nonzero_in_time_and_a_restart_resumes(tmp_path):
    # --rpc_timeout 30, not the chaos topology's 10: it is how long a worker's first call to the
    # PS's store may take once the port accepts, and under CI's load a worker's handshake still
    # timed out (StoreUnreachable) and exited 1 before the kill.
    base = chaos_common.chaos_topology()
    t = base.model_copy(update={"ps": dataclasses.replace(base.ps, rpc_timeout=30)})
    out = chaos_processes.ps_kill(tmp_path, t)
    print(f"PS killed: workers exited after {out.details['worker_exits']}")

    assert out.recovered, _explain(out, tmp_path)
    # A bound that is the behaviour: workers that lose the PS exit within the RPC timeout
    # instead of hanging; + 10 s for a loaded host. Measured 0.07-0.1 s.
    for name, (code, seconds) in out.details["worker_exits"].items():
        assert code == 1 and seconds <= t.ps.rpc_timeout + 10, (name, code, seconds)
        errors = [line for line in _starts(tmp_path, name)[0].splitlines() if " ERROR " in line]
        # the PS's UNIX socket, in the run's private directory
        assert len(errors) == 1 and re.search(r"lost the parameter server at /\S+/ps\.sock ", errors[0]), errors
    assert out.details["resumed_version"] >= 200
    assert out.accuracy >= 0.90  # the uninterrupted run's target


def test_a_killed_ps_shard_is_started_again_and_takes_its_slice_back_from_its_checkpoint(tmp_path):
    """`make chaos`'s ps-shard-kill: the PS notices the lost shard, the shard started again
    restores its slice from its checkpoint labelled with the PS's version (not the initial
    values), the workers that lost it rejoin, and the run ends 0 at the usual accuracy."""
    out = chaos_processes.ps_shard_kill(tmp_path)
    print(f"PS shard killed: noticed after {out.detected_s:.1f} s, whole again after {out.recovered_s:.1f} s")

    assert out.recovered, _explain(out, tmp_path)
    assert out.accuracy >= 0.90
    assert set(out.details["exit_codes"].values()) == {0}
    assert out.details["lost"]["shard"] == 1
    shard_log = _starts(tmp_path, "ps-shard1")[1]
    resumed = re.search(r"resumed from ckpt-\d+-\w+\.pt \(the main parameter server's version (\d+)\)", shard_log)
    assert resumed and int(resumed.group(1)) >= 200, shard_log


def test_kills_during_checkpoint_writes_never_leave_a_bad_checkpoint(tmp_path):
    out = chaos_checkpoints.kill_loop(tmp_path, rounds=8)

    assert out.recovered, out.details["problems"]
    assert out.details["mid_write"] >= 2  # the kills did land inside writes


def test_a_rank_already_taken_is_refused_and_sigterm_checkpoints_the_ps(tmp_path):
    t = chaos_common.chaos_topology(workers=1)
    # No periodic checkpoint: a SIGTERM that came just after one, with no push applied since,
    # found that version on disk already, and the PS rightly wrote no "on exit" checkpoint.
    t = t.model_copy(
        update={
            "train": dataclasses.replace(t.train, epochs=500),
            "ps": dataclasses.replace(t.ps, checkpoint_every=0),
        }
    )
    job = TargetRun.local(t, tmp_path)
    try:
        job.up()
        chaos_common.wait_until("worker1 trains", lambda: job.events("worker1", "train"), 120)
        # worker1 started a second time by hand, with the environment of the one that trains
        state = json.loads((job.run_dir / "local-state.json").read_text())
        environ = Path(f"/proc/{state['services']['worker1']['pid']}/environ").read_bytes()
        env = dict(item.split("=", 1) for item in environ.decode().split("\0") if "=" in item)
        second = subprocess.run(
            [sys.executable, "-m", "app", "worker"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120
        )
        assert second.returncode == 2, second.stderr[-2000:]
        assert "app: error: rank 1 is already taken by worker1, which is running" in second.stderr, second.stderr
        first = job.service_states()["worker1"]
        assert first.running and first.restarts == 0  # the first one trains on

        # A bound that is the behaviour: on SIGTERM the PS checkpoints and exits inside
        # compose's stop_grace_period (30 s) before SIGKILL would cut the checkpoint short.
        wall = job.signal("ps", "SIGTERM")
        code, _ = chaos_common.wait_until("the PS exits", lambda: job.failures(wall).get("ps"), 25)
        assert code == 143
        on_exit = [r for r in job.events("ps", "checkpoint") if r["why"] == "on exit"]
        assert len(on_exit) == 1 and (job.run_dir / "checkpoints" / on_exit[0]["file"]).is_file()
        # A bound that is the behaviour (as above): the worker exits 1 once its PS is gone,
        # within the RPC timeout (+ 10 s), instead of hanging.
        code, _ = chaos_common.wait_until(
            "worker1 exits", lambda: job.failures(wall).get("worker1"), t.ps.rpc_timeout + 10
        )
        assert code == 1
    finally:
        job.close()
