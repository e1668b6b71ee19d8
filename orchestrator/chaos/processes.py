"""Chaos scenarios as local processes: the chaos topology on the local target (a launcher and
its processes, orchestrator/backends/local/), hit through the target's blocks.

The faults every target runs (chaos.faults: kill -9 a worker, the PS, a PS shard), each process
that fails started again by the launcher as compose's `restart: on-failure` does; and SIGSTOP a
worker (frozen) and SIGCONT it. The failure tests (tests/failure/) run the same scenarios and
assert on their details.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Optional

from app.contract import Event
from orchestrator.backends.target_run import TargetRun
from orchestrator.chaos import faults
from orchestrator.chaos.common import RUN_TIMEOUT, Outcome, Scenario, Timeout, chaos_topology, wait_until
from orchestrator.topology.model import Topology
from orchestrator.topology.services import PS_SERVICE


def _run(fault: str, strike: Callable[[TargetRun, Outcome], Outcome], runs_dir: Path, t: Optional[Topology]) -> Outcome:
    """`strike` a run of `t` on the local target, its directory runs_dir/<name>/."""
    job = TargetRun.local(t or chaos_topology(), runs_dir)
    out = Outcome(fault)
    try:
        job.up()
        return strike(job, out)
    except Timeout as error:
        out.notes = str(error)
        return out
    finally:
        job.close()


def worker_kill(runs_dir: Path, t: Optional[Topology] = None, victim: str = "worker2") -> Outcome:
    """chaos.faults.worker_kill as processes."""
    fault = "kill -9 a worker, started again (processes)"
    return _run(fault, lambda job, out: faults.worker_kill(job, out, victim), runs_dir, t)


def ps_kill(runs_dir: Path, t: Optional[Topology] = None) -> Outcome:
    """chaos.faults.ps_kill as processes."""
    return _run("kill -9 the PS, started again (processes)", faults.ps_kill, runs_dir, t)


def ps_shard_kill(runs_dir: Path, t: Optional[Topology] = None) -> Outcome:
    """chaos.faults.ps_shard_kill as processes."""
    fault = "kill -9 a PS shard (ps.shards: 2), started again (processes)"
    return _run(fault, faults.ps_shard_kill, runs_dir, faults.sharded(t))


def freeze(job: TargetRun, out: Outcome, victim: str = "worker2") -> Outcome:
    """SIGSTOP a worker: the PS drops it at the RPC timeout and trains on. SIGCONT: if its own
    call to the PS timed out meanwhile it exits 1, is started again and rejoins; if not, the PS
    readmits it when it calls again."""
    wait_until(f"{victim} at epoch 5", lambda: faults.training(job, victim, 5), RUN_TIMEOUT)
    wall = job.signal(victim, "SIGSTOP")
    drop = wait_until("the PS drops it", lambda: job.events(PS_SERVICE, Event.DROP, wall), job.t.ps.rpc_timeout + 15)
    out.detected_s = drop[0]["time"] - wall
    job.signal(victim, "SIGCONT")

    def back_or_rejoined() -> list:
        return job.events(PS_SERVICE, Event.BACK, wall) or job.events(PS_SERVICE, Event.JOIN, wall)

    back = wait_until("it is readmitted or rejoins", back_or_rejoined, RUN_TIMEOUT)
    if job.events(PS_SERVICE, Event.BACK, wall):
        out.notes = "thawed, it called again and was readmitted"
    else:
        out.notes = f"thawed, its timed-out call made it exit; started again, {back[0]['worker']} rejoined"
    out.recovered_s = back[0]["time"] - wall
    out.details["back"] = back[0]
    out.notes = f"dropped after {out.detected_s:.1f} s (rpc_timeout {job.t.ps.rpc_timeout} s); " + out.notes
    return faults.judge(job, out)


def worker_freeze(runs_dir: Path, t: Optional[Topology] = None, victim: str = "worker2") -> Outcome:
    """`freeze` as processes."""
    fault = "freeze a worker (SIGSTOP) past the RPC timeout, thaw it"
    return _run(fault, lambda job, out: freeze(job, out, victim), runs_dir, t)


SCENARIOS: dict[str, Scenario] = {
    "worker-kill": worker_kill,
    "worker-freeze": worker_freeze,
    "ps-kill": ps_kill,
    "ps-shard-kill": ps_shard_kill,
}
