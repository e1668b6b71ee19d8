"""The faults every target's chaos runs, written once against a running job (`Job`): kill -9 a
worker, the PS, a PS shard, mid-run; the target starts what failed again (compose's `restart:
on-failure`, and the processes' job as it does), and the run must end as an uninterrupted one.

A target's job gives the blocks: the run's records (`events`), a kill of a service's app
(`kill`), how often a service was started again (`restarts`), the services seen failing since a
time (`failures`), and every service's exit status once all have ended for good (`ended`):
`chaos.processes.ProcessJob` (local processes) and `chaos.containers.ContainerJob` (a compose
project on the engine).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Optional, Protocol

from app.contract import Event
from orchestrator.chaos.common import CHECKPOINT_VERSION, RUN_TIMEOUT, THRESHOLD, Outcome, chaos_topology, wait_until
from orchestrator.metrics.records import Record
from orchestrator.topology.model import Topology
from orchestrator.topology.services import PS_SERVICE, by_name, service_names, shard_service


class Job(Protocol):
    """A running job of one target, as a fault sees it."""

    t: Topology

    def events(self, name: str, event: Event, since: float = 0.0) -> list[Record]: ...
    def kill(self, name: str) -> float: ...  # SIGKILL the app of `name`; the unix time just before
    def restarts(self, name: str) -> int: ...  # times `name` was started again after it failed
    def failures(self, since: float) -> dict[str, tuple[Optional[int], float]]: ...  # name -> (status, when seen)
    def ended(self, timeout: float = RUN_TIMEOUT) -> dict[str, int]: ...  # every service's last exit status


def sharded(t: Optional[Topology] = None) -> Topology:
    """The chaos topology with its PS split in two (ps.shards: 2)."""
    t = t or chaos_topology()
    return t.model_copy(update={"ps": dataclasses.replace(t.ps, shards=2)})


def workers(t: Topology) -> list[str]:
    """The worker services a run of `t` starts."""
    known = by_name(t)
    return [name for name in service_names(t) if known[name].role == "worker"]


def training(job: Job, worker: str, epoch: int) -> bool:
    """Whether `worker` has trained in `epoch` or later."""
    return any(r["epoch"] >= epoch for r in job.events(worker, Event.TRAIN))


def wait_mid_run(job: Job) -> None:
    """Until every worker trains and the PS has a checkpoint at version >= CHECKPOINT_VERSION:
    the PS faults strike a job in full swing. On a loaded host one worker can still be starting
    (importing torch, loading its shard) when the others have pushed that far, and a PS killed
    then meets it in its store handshake, not mid-push."""
    wait_until("every worker trains", lambda: all(training(job, w, 0) for w in workers(job.t)), RUN_TIMEOUT)
    wait_until(
        f"a checkpoint at version >= {CHECKPOINT_VERSION}",
        lambda: [r for r in job.events(PS_SERVICE, Event.CHECKPOINT) if r["step"] >= CHECKPOINT_VERSION],
        RUN_TIMEOUT,
    )


def judge(job: Job, out: Outcome, extra: Callable[[], bool] = lambda: True) -> Outcome:
    """Once every service has ended: recovered when each exited 0, the PS's last accuracy is the
    uninterrupted run's, and `extra` holds. The exit statuses and restarts go in the details."""
    codes = job.ended()
    ends = job.events(PS_SERVICE, Event.END)
    out.accuracy = ends[-1]["accuracy"] if ends else None
    out.details.update(exit_codes=codes, restarts={name: job.restarts(name) for name in codes})
    ok = all(code == 0 for code in codes.values()) and (out.accuracy or 0) >= THRESHOLD
    out.recovered = ok and extra()
    return out


def worker_kill(job: Job, out: Outcome, victim: str = "worker2") -> Outcome:
    """kill -9 a worker mid-run: the PS drops it within its rpc_timeout, it is started again,
    rejoins under a new name and pushes, and the run completes."""
    wait_until(f"{victim} at epoch 5", lambda: training(job, victim, 5), RUN_TIMEOUT)
    wall = job.kill(victim)
    drop = wait_until("the PS drops it", lambda: job.events(PS_SERVICE, Event.DROP, wall), job.t.ps.rpc_timeout + 10)
    out.detected_s = drop[0]["time"] - wall
    join = wait_until("it rejoins", lambda: job.events(PS_SERVICE, Event.JOIN, drop[0]["time"]), RUN_TIMEOUT)
    out.recovered_s = join[0]["time"] - wall
    out.details.update(drop=drop[0], rejoin=join[0], kill_time=wall)
    out.notes = f"{drop[0]['worker']} dropped, {join[0]['worker']} resumed at epoch {join[0]['epoch']}"

    def pushed_again() -> bool:
        after = [r for r in job.events(victim, Event.TRAIN) if r["time"] > join[0]["time"]]
        out.details["pushes_after_rejoin"] = len(after)
        return bool(after) and job.restarts(victim) >= 1

    return judge(job, out, pushed_again)


def ps_kill(job: Job, out: Outcome) -> Outcome:
    """kill -9 the PS mid-run: every worker exits non-zero within rpc_timeout + 10 s; started
    again, the PS resumes from its newest checkpoint and the workers rejoin it."""
    wait_mid_run(job)
    names = workers(job.t)
    wall = job.kill(PS_SERVICE)

    def all_failed() -> dict[str, tuple[Optional[int], float]]:
        failed = {n: f for n, f in job.failures(wall).items() if n in names}
        return failed if len(failed) == len(names) else {}

    failed = wait_until("every worker exits non-zero", all_failed, job.t.ps.rpc_timeout + 10)
    exits = {name: (code, round(seen - wall, 2)) for name, (code, seen) in failed.items()}
    out.detected_s = max(seconds for _, seconds in exits.values())
    out.details["worker_exits"] = exits
    resume = wait_until("the PS resumes", lambda: job.events(PS_SERVICE, Event.RESUME, wall), RUN_TIMEOUT)
    push = wait_until(
        "a worker trains again",
        lambda: [r for n in names for r in job.events(n, Event.TRAIN, resume[0]["time"])],
        RUN_TIMEOUT,
    )
    out.recovered_s = min(r["time"] for r in push) - wall
    out.details.update(resumed_version=resume[0]["step"], resumed_from=resume[0]["checkpoint"])
    out.notes = (
        f"workers exited {sorted({str(c) for c, _ in exits.values()})} within {out.detected_s:.1f} s; "
        f"the PS was started again and resumed from version {resume[0]['step']}"
    )
    return judge(job, out, lambda: resume[0]["step"] > 0 and job.restarts(PS_SERVICE) >= 1)


def ps_shard_kill(job: Job, out: Outcome) -> Outcome:
    """kill -9 one PS shard (ps.shards: 2) mid-run, after a checkpoint: the PS notices it lost the
    shard; the shard is started again and takes its slice back from its checkpoint labelled with
    the PS's version; workers that lost it are started again and rejoin; the run completes."""
    shard = shard_service(1)
    wait_mid_run(job)
    wall = job.kill(shard)
    lost = wait_until(
        "the PS notices", lambda: job.events(PS_SERVICE, Event.SHARD_LOST, wall), job.t.ps.rpc_timeout + 10
    )
    out.detected_s = lost[0]["time"] - wall
    back = wait_until("the shard registers again", lambda: job.events(PS_SERVICE, Event.SHARD, wall), RUN_TIMEOUT)
    push = wait_until(
        "a worker trains again",
        lambda: [r for w in workers(job.t) for r in job.events(w, Event.TRAIN, back[0]["time"])],
        RUN_TIMEOUT,
    )
    out.recovered_s = min(r["time"] for r in push) - wall
    out.details["lost"] = lost[0]
    out.notes = f"the PS lost the shard after {out.detected_s:.1f} s; started again, it resumed its slice"

    def resumed() -> bool:
        out.details["shard_resume"] = job.events(shard, Event.RESUME, wall)
        return bool(out.details["shard_resume"]) and job.restarts(shard) >= 1

    return judge(job, out, resumed)
