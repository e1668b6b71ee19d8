"""The soak's faults, one function per kind (soak_plan.KINDS): inject it into the running job,
wait until the job is whole and training again (read from the PS's records), and say how it
went. A fault with no target (no worker running) is skipped, not injected.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

from docker.errors import APIError

from app.contract import Event
from orchestrator.chaos.soak_checks import FaultResult, Shm, restarted, segment_replaced, slot_reused
from orchestrator.chaos.soak_job import SoakJob
from orchestrator.chaos.soak_plan import Step, choose, scale_to
from orchestrator.metrics.records import Record, events
from orchestrator.topology.services import PS_SERVICE, shard_service

POLL_S = 1.0
SEGMENT_WAIT_S = 20.0  # a restarted process names its segment in its log soon after it joins
SHARD = shard_service(1)
PAUSE_TRIES, PAUSE_RETRY_S = 5, 2.0  # docker pause: runc's freezer may give up on a busy container


@dataclass
class Context:
    """What the faults share: the job's shape and what the soak learned along the way."""

    count: int  # workers.count
    most: int  # workers.max
    rpc_timeout: float
    recovery_s: float  # how long a fault may take to recover before it is called unrecovered
    corrupted: set[str] = field(default_factory=set)  # checkpoint files the soak damaged
    scaled: set[str] = field(default_factory=set)  # services a scale started (then stopped)


def wait_for(check: Callable[[], Any], timeout: float) -> Any:
    """Poll `check` every POLL_S until it returns something truthy; None at the timeout."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value or time.monotonic() > deadline:
            return value or None
        time.sleep(POLL_S)


def ps_after(job: SoakJob, since: float, *wanted: Event, rank: Optional[int] = None) -> list[Record]:
    """The PS's records of the events `wanted` since `since` (of worker `rank`, when given)."""
    found = [r for e in wanted for r in events(job.records(), e, since)]
    return sorted((r for r in found if rank is None or r.get("worker_rank") == rank), key=lambda r: r["time"])


def rank_of(service: str) -> int:
    return int(service.removeprefix("worker"))


def base_workers(job: SoakJob, ctx: Context) -> list[str]:
    """The running workers among ranks 1..workers.count."""
    return [s for s in job.running("worker") if rank_of(s) <= ctx.count]


def trains_after(job: SoakJob, since: float, version: int, timeout: float) -> Optional[Record]:
    """The PS's first evaluation after `since` past `version`: the job trains again."""
    evals = wait_for(lambda: [r for r in ps_after(job, since, Event.EVAL) if r["step"] > version], timeout)
    return evals[0] if evals else None


Process = tuple[int, frozenset[str]]  # (pid, the segments it maps): Shm.process


def process_of(job: SoakJob, service: str) -> Optional[Process]:
    shm = job.shm()
    return shm.process(service) if shm is not None else None


def observe_restart(
    job: SoakJob, service: str, before: Optional[Process], judge: Callable[[Process, Shm, str], bool]
) -> Optional[bool]:
    """`judge` of `service`'s new process against the one killed, once it maps its segments;
    None when the killed one mapped none (no shared-memory exchange, or /proc not readable)."""
    if before is None or not before[1]:
        return None

    def new_process() -> Optional[Shm]:
        now = job.shm()
        return now if now is not None and restarted(before, now, service) else None

    after = wait_for(new_process, SEGMENT_WAIT_S)
    return judge(before, after, service) if after is not None else False


def worker_kill(job: SoakJob, step: Step, ctx: Context) -> FaultResult:
    """SIGKILL a worker's app; Docker restarts it, it rejoins (the PS's `join` of its rank)."""
    candidates = base_workers(job, ctx)
    if not candidates:
        return FaultResult("worker-kill", "-", time.time(), skipped="no worker running")
    target = choose(candidates, step.pick)
    before = process_of(job, target)
    start = job.signal(target, "SIGKILL")
    out = FaultResult("worker-kill", target, start)
    joins = wait_for(lambda: ps_after(job, start, Event.JOIN, rank=rank_of(target)), ctx.recovery_s)
    drops = ps_after(job, start, Event.DROP, rank=rank_of(target))
    out.detected_s = drops[0]["time"] - start if drops else None
    if not joins:
        out.notes = f"{target} did not rejoin within {ctx.recovery_s:.0f} s"
        return out
    out.recovered_s = joins[0]["time"] - start
    out.segment_reused = observe_restart(job, target, before, slot_reused)
    out.notes = f"{joins[0]['worker']} back in the job (version {joins[0]['step']})"
    return out


def worker_term(job: SoakJob, step: Step, ctx: Context) -> FaultResult:
    """SIGTERM a worker's app: it leaves the job (exit 0, not restarted); the soak starts it
    again as `make scale` back to workers.count does, and it rejoins."""
    candidates = base_workers(job, ctx)
    if not candidates:
        return FaultResult("worker-term", "-", time.time(), skipped="no worker running")
    target = choose(candidates, step.pick)
    rank, restarts = rank_of(target), job.states()[target]["restarts"]
    before = process_of(job, target)
    start = job.signal(target, "SIGTERM")
    out = FaultResult("worker-term", target, start)

    def stopped() -> Optional[str]:  # exited (it left: exit 0), or restarted by Docker (exit 143)
        now = job.states()[target]
        return now["status"] if now["status"] == "exited" or now["restarts"] > restarts else None

    if wait_for(stopped, 60) == "exited":
        wait_for(lambda: PS_SERVICE in job.running(), ctx.recovery_s)
        job.scale(ctx.count)
    left = ps_after(job, start, Event.LEFT, rank=rank)
    joins = wait_for(lambda: ps_after(job, start, Event.JOIN, rank=rank), ctx.recovery_s)
    how = f"left at version {left[0]['step']}" if left else f"exit {job.states()[target]['exit_code']}"
    if not joins:
        out.notes = f"{target} {how}; not back within {ctx.recovery_s:.0f} s"
        return out
    out.detected_s = left[0]["time"] - start if left else None
    out.recovered_s = joins[0]["time"] - start
    out.segment_reused = observe_restart(job, target, before, slot_reused)
    out.notes = f"{target} {how}; started again, back in the job (version {joins[0]['step']})"
    return out


def ps_kill(job: SoakJob, step: Step, ctx: Context, corrupt: bool = False) -> FaultResult:
    """SIGKILL the PS's app (and with `corrupt`, damage its newest checkpoint before it comes
    back): Docker restarts it, it resumes, the job trains again."""
    before = process_of(job, PS_SERVICE)
    start = job.signal(PS_SERVICE, "SIGKILL")
    out = FaultResult("corrupt" if corrupt else "ps-kill", PS_SERVICE, start)
    damaged = job.corrupt_newest() if corrupt else {}
    if damaged:
        ctx.corrupted.add(damaged["file"])
        out.corrupted = damaged["file"]
    starts = wait_for(lambda: ps_after(job, start, Event.START), ctx.recovery_s)
    if not starts:
        out.notes = f"the PS did not start again within {ctx.recovery_s:.0f} s"
        return out
    trained = trains_after(job, starts[0]["time"], starts[0]["step"], ctx.recovery_s)
    what = f"damaged {damaged['file']}; " if damaged else ""
    out.notes = f"{what}resumed at version {starts[0]['step']}"
    if trained is None:
        out.notes += f"; no training within {ctx.recovery_s:.0f} s"
        return out
    out.recovered_s = trained["time"] - start
    out.segment_gone = observe_restart(job, PS_SERVICE, before, segment_replaced)
    return out


def corrupt(job: SoakJob, step: Step, ctx: Context) -> FaultResult:
    return ps_kill(job, step, ctx, corrupt=True)


def shard_kill(job: SoakJob, step: Step, ctx: Context) -> FaultResult:
    """SIGKILL PS shard 1's app: the PS loses it, Docker restarts it, it registers again."""
    before = process_of(job, SHARD)
    start = job.signal(SHARD, "SIGKILL")
    out = FaultResult("shard-kill", SHARD, start)
    back = wait_for(lambda: ps_after(job, start, Event.SHARD), ctx.recovery_s)
    lost = ps_after(job, start, Event.SHARD_LOST)
    out.detected_s = lost[0]["time"] - start if lost else None
    if not back:
        out.notes = f"the shard did not register again within {ctx.recovery_s:.0f} s"
        return out
    trained = trains_after(job, back[0]["time"], back[0]["step"], ctx.recovery_s)
    if trained is None:
        out.notes = f"the shard registered again; no training within {ctx.recovery_s:.0f} s"
        return out
    out.recovered_s = trained["time"] - start
    out.segment_gone = observe_restart(job, SHARD, before, segment_replaced)
    out.notes = f"registered again after {back[0]['time'] - start:.1f} s; training at version {trained['step']}"
    return out


def scale(job: SoakJob, step: Step, ctx: Context) -> FaultResult:
    """`make scale` up to a count above workers.count, then back: the new ranks join and train,
    then leave cleanly (`left`, exit 0)."""
    most = scale_to(ctx.count, ctx.most, step.pick)
    ranks = set(range(ctx.count + 1, most + 1))
    wait_for(lambda: PS_SERVICE in job.running(), ctx.recovery_s)  # `make scale` acts on a running PS
    start = time.time()
    started, _ = job.scale(most)
    out = FaultResult("scale", f"{ctx.count} -> {most} -> {ctx.count}", start)
    ctx.scaled.update(s for s in started if rank_of(s) in ranks)

    def joined() -> list[Record]:
        found = ps_after(job, start, Event.JOIN)
        return found if ranks <= {r.get("worker_rank") for r in found} else []

    joins = wait_for(joined, ctx.recovery_s)
    trained = trains_after(job, max(r["time"] for r in joins), 0, ctx.recovery_s) if joins else None
    down = time.time()
    job.scale(ctx.count)

    def gone() -> list[Record]:
        found = ps_after(job, down, Event.LEFT, Event.DROP)
        return found if ranks <= {r.get("worker_rank") for r in found} else []

    left = wait_for(gone, ctx.recovery_s)
    if not (joins and trained and left):
        missing = "join" if not joins else "train" if not trained else "leave"
        out.notes = f"the new workers did not {missing} within {ctx.recovery_s:.0f} s"
        return out
    drops = [r["worker"] for r in left if r["event"] == Event.DROP]
    out.detected_s = max(r["time"] for r in joins if r.get("worker_rank") in ranks) - start
    out.recovered_s = max(r["time"] for r in left) - start
    out.notes = f"joined, trained and left ({', '.join(sorted(started))})" + (f"; DROPPED {drops}" if drops else "")
    if drops:
        out.recovered_s = None  # a scale down is a clean leave, never a drop
    return out


def pause_container(container: Any, tries: int = PAUSE_TRIES) -> int:
    """`docker pause` the container; the try it took. runc's freezer gives up on a cgroup whose
    processes do not all freeze in time ("unable to freeze", moby/moby#48205; seen on a loaded
    2-core CPU VM), thaws it again and fails: that try is repeated after PAUSE_RETRY_S."""
    for attempt in range(1, tries + 1):
        try:
            container.pause()
            return attempt
        except APIError as error:
            if "unable to freeze" not in str(error) or attempt == tries:
                raise
            time.sleep(PAUSE_RETRY_S)
    raise AssertionError("unreachable")


def pause(job: SoakJob, step: Step, ctx: Context) -> FaultResult:
    """`docker pause` a worker until the PS drops it (past the RPC timeout), `step.hold_s`
    more, then unpause: it comes back (`back`), or fails and is restarted (`join`)."""
    candidates = base_workers(job, ctx)
    if not candidates:
        return FaultResult("pause", "-", time.time(), skipped="no worker running")
    target = choose(candidates, step.pick)
    rank, container = rank_of(target), job.containers()[target]
    start = time.time()
    tries = pause_container(container)
    out = FaultResult("pause", target, start)
    try:
        drops = wait_for(lambda: ps_after(job, start, Event.DROP, rank=rank), ctx.rpc_timeout + 30)
        time.sleep(step.hold_s)
    finally:
        # The time just before: the worker runs again before the engine's answer to unpause
        # comes back, and its next push may be readmitted (`back`) within those milliseconds.
        thawed = time.time()
        container.unpause()
    back = wait_for(lambda: ps_after(job, thawed, Event.BACK, Event.JOIN, rank=rank), ctx.recovery_s)
    out.detected_s = drops[0]["time"] - start if drops else None
    held = f"paused {thawed - start:.0f} s" + (
        f" (paused at try {tries}: runc could not freeze it before)" if tries > 1 else ""
    )
    if not drops:
        out.notes = f"{held}; the PS did not drop it within {ctx.rpc_timeout + 30:.0f} s"
        return out
    if not back:
        out.notes = f"{held}; dropped after {out.detected_s:.1f} s; not back within {ctx.recovery_s:.0f} s"
        return out
    out.recovered_s = back[0]["time"] - start
    out.notes = f"{held}; dropped after {out.detected_s:.1f} s; {back[0]['event']} at version {back[0]['step']}"
    return out


def fill(job: SoakJob, step: Step, ctx: Context) -> FaultResult:
    """Fill the state volume's free space for `step.hold_s` seconds, then free it: the PS
    checkpoints again (a `checkpoint` record after the space came back)."""
    start = time.time()
    out = FaultResult("fill", "the state volume", start)
    restarts = {s: v["restarts"] for s, v in job.states().items()}
    info = job.fill(step.hold_s)
    filled, released = info["filled"], info["released"]
    checkpoints = wait_for(lambda: ps_after(job, released, Event.CHECKPOINT), ctx.recovery_s)
    meanwhile = [r for r in ps_after(job, filled, Event.CHECKPOINT) if r["time"] <= released]
    held = f"filled {info['written'] / 1e6:.1f} MB for {released - filled:.1f} s"
    held += f" ({len(meanwhile)} checkpoints written meanwhile)"
    crashed = sorted(s for s, v in job.states().items() if v["restarts"] > restarts.get(s, 0))
    out.details["restarted"] = crashed  # judged by soak_checks.full_volume_restarts_none
    if crashed:
        held += f"; Docker restarted {', '.join(crashed)} meanwhile"
    if not checkpoints:
        out.notes = f"{held}; no checkpoint within {ctx.recovery_s:.0f} s after"
        return out
    out.recovered_s = checkpoints[0]["time"] - start
    out.notes = f"{held}; checkpointed again at version {checkpoints[0]['step']}"
    return out


FAULTS: dict[str, Callable[[SoakJob, Step, Context], FaultResult]] = {
    "worker-kill": worker_kill,
    "worker-term": worker_term,
    "ps-kill": ps_kill,
    "shard-kill": shard_kill,
    "scale": scale,
    "pause": pause,
    "fill": fill,
    "corrupt": corrupt,
}
