"""`python -m orchestrator chaos`: inject faults into a CPU run, check it recovers, print a table.

Each scenario runs the cpu-smoke topology (3 workers, more epochs so that a
fault lands mid-run, short timeouts) and returns an `Outcome`: did the run
recover, how long until the PS noticed, how long until the job was whole
again, the final held-out accuracy. The failure tests (tests/failure/) run
the same scenarios and assert on their details.

As processes (`ProcessJob`): kill -9 a worker and start it again; SIGSTOP a
worker (frozen) and SIGCONT it; kill -9 the PS, then restart everything;
kill -9 a process in the middle of checkpoint writes, again and again. In
containers: orchestrator/chaos_containers.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, TextIO

from orchestrator.local import free_port, loopback_ifname, service_environment
from orchestrator.services import by_name
from orchestrator.topology import Topology, load

CONFIG = "configs/cpu-smoke.yaml"
THRESHOLD = 0.90
RUN_TIMEOUT = 300.0  # seconds for a whole scenario's run
POLL = 0.2


def chaos_topology(config: str = CONFIG, workers: int = 3) -> Topology:
    """The smoke topology with runs long enough to be hit mid-run, and short timeouts."""
    t = load(config).with_workers(workers)
    train = t.train.model_copy(update={"epochs": 30, "eval_every": 500, "log_every": 5})
    ps = t.ps.model_copy(update={"rpc_timeout": 10, "join_timeout": 60, "checkpoint_every": 100})
    return t.model_copy(update={"train": train, "ps": ps})


@dataclass
class Outcome:
    fault: str
    recovered: bool
    detected_s: Optional[float]   # fault -> the PS (or the workers) noticed
    recovered_s: Optional[float]  # fault -> the job is whole and training again
    accuracy: Optional[float]
    notes: str = ""
    details: dict[str, Any] = field(default_factory=dict)


class Timeout(Exception):
    pass


def wait_until(what: str, check: Callable[[], Any], timeout: float) -> Any:
    """Poll `check` until it returns something truthy; Timeout naming `what`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(POLL)
    raise Timeout(f"{what}: not within {timeout:.0f} s")


class ProcessJob:
    """The PS and workers of a topology as local processes, started and hit one by one."""

    def __init__(self, t: Topology, run_dir: Path) -> None:
        self.t, self.run_dir = t, run_dir
        self.port = free_port()
        self.ifname = loopback_ifname()
        self.procs: dict[str, subprocess.Popen] = {}
        self.starts: dict[str, int] = {}
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)

    def start(self, *names: str) -> None:
        known = by_name(self.t)
        for name in names or list(known):
            service = known[name]
            env = service_environment(self.t, service, port=self.port, run_dir=self.run_dir, ifname=self.ifname)
            n = self.starts[name] = self.starts.get(name, 0) + 1
            with open(self.run_dir / "logs" / f"{name}.{n}.out", "w") as out, \
                    open(self.run_dir / "logs" / f"{name}.{n}.err", "w") as err:
                self.procs[name] = subprocess.Popen(
                    [sys.executable, "-m", "app", service.role],
                    env={**os.environ, **env}, stdout=out, stderr=err, stdin=subprocess.DEVNULL)

    def signal(self, name: str, sig: int) -> float:
        self.procs[name].send_signal(sig)
        return time.monotonic()

    def wait_exit(self, name: str, timeout: float) -> int:
        try:
            return self.procs[name].wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise Timeout(f"{name} did not exit within {timeout:.0f} s") from None

    def wait_all(self, timeout: float = RUN_TIMEOUT) -> dict[str, int]:
        deadline = time.monotonic() + timeout
        return {n: self.wait_exit(n, max(0.1, deadline - time.monotonic())) for n in list(self.procs)}

    def events(self, name: str, event: str, since: float = 0.0) -> list[dict[str, Any]]:
        """Metrics records of one process (`ps`, `worker2`) with this event, written after `since` (unix time)."""
        path = self.run_dir / "metrics" / by_name(self.t)[name].metrics_file
        if not path.is_file():
            return []
        with open(path, encoding="utf-8") as f:
            records = [json.loads(line) for line in f if line.strip().endswith("}")]
        return [r for r in records if r["event"] == event and r["time"] >= since]

    def log(self, name: str, n: int = 1) -> str:
        return (self.run_dir / "logs" / f"{name}.{n}.err").read_text(encoding="utf-8", errors="replace")

    def close(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()


def _accuracy(job: ProcessJob) -> Optional[float]:
    ends = job.events("ps", "end")
    return ends[-1]["accuracy"] if ends else None


def _training(job: ProcessJob, worker: str, epoch: int) -> bool:
    return any(r["epoch"] >= epoch for r in job.events(worker, "train"))


def _finish(job: ProcessJob, outcome: Outcome, expect_ok: Callable[[], bool]) -> Outcome:
    codes = job.wait_all()
    outcome.details["exit_codes"] = codes
    outcome.accuracy = _accuracy(job)
    good = all(c == 0 for c in codes.values()) and (outcome.accuracy or 0) >= THRESHOLD
    outcome.recovered = good and expect_ok()
    return outcome


def worker_kill(run_dir: Path, t: Optional[Topology] = None, victim: str = "worker2") -> Outcome:
    """kill -9 a worker mid-run; start it again; it rejoins under a new name and trains on."""
    job = ProcessJob(t or chaos_topology(), run_dir)
    out = Outcome("kill -9 a worker, start it again (processes)", False, None, None, None)
    try:
        job.start()
        wait_until(f"{victim} at epoch 5", lambda: _training(job, victim, 5), RUN_TIMEOUT)
        start, wall = job.signal(victim, signal.SIGKILL), time.time()
        job.wait_exit(victim, 10)
        drop = wait_until("the PS drops it", lambda: job.events("ps", "drop", wall), job.t.ps.rpc_timeout + 10)
        out.detected_s = drop[0]["time"] - wall
        job.start(victim)
        join = wait_until("it rejoins", lambda: job.events("ps", "join", drop[0]["time"]), RUN_TIMEOUT)
        out.recovered_s = join[0]["time"] - wall
        out.details.update(drop=drop[0], rejoin=join[0], kill_time=wall)
        out.notes = f"{drop[0]['worker']} dropped, {join[0]['worker']} resumed at epoch {join[0]['epoch']}"

        def pushed_again() -> bool:
            after = [r for r in job.events(victim, "train") if r["time"] > join[0]["time"]]
            out.details["pushes_after_rejoin"] = len(after)
            return bool(after)
        return _finish(job, out, pushed_again)
    except Timeout as error:
        out.notes = str(error)
        return out
    finally:
        job.close()


def worker_freeze(run_dir: Path, t: Optional[Topology] = None, victim: str = "worker2") -> Outcome:
    """SIGSTOP a worker: the PS drops it at the RPC timeout and trains on. SIGCONT: if its
    own call to the PS timed out meanwhile it exits 1 and is started again (as compose's
    restart does) and rejoins; if not, the PS readmits it when it calls again."""
    job = ProcessJob(t or chaos_topology(), run_dir)
    out = Outcome("freeze a worker (SIGSTOP) past the RPC timeout, thaw it", False, None, None, None)
    try:
        job.start()
        wait_until(f"{victim} at epoch 5", lambda: _training(job, victim, 5), RUN_TIMEOUT)
        job.signal(victim, signal.SIGSTOP)
        wall = time.time()
        drop = wait_until("the PS drops it", lambda: job.events("ps", "drop", wall), job.t.ps.rpc_timeout + 15)
        out.detected_s = drop[0]["time"] - wall
        job.signal(victim, signal.SIGCONT)
        code = job.wait_exit(victim, RUN_TIMEOUT)
        if code == 0:
            back = wait_until("it is readmitted", lambda: job.events("ps", "back", wall), 1)
            out.notes = "thawed, it called again and was readmitted"
        else:
            job.start(victim)
            back = wait_until("it rejoins", lambda: job.events("ps", "join", wall), RUN_TIMEOUT)
            out.notes = f"thawed, its timed-out call made it exit {code}; started again, {back[0]['worker']} rejoined"
        out.recovered_s = back[0]["time"] - wall
        out.notes = f"dropped after {out.detected_s:.1f} s (rpc_timeout {job.t.ps.rpc_timeout} s); " + out.notes
        return _finish(job, out, lambda: True)
    except Timeout as error:
        out.notes = str(error)
        return out
    finally:
        job.close()


def ps_kill(run_dir: Path, t: Optional[Topology] = None) -> Outcome:
    """kill -9 the PS mid-run: every worker exits non-zero within rpc_timeout + 10 s;
    start them all again: the PS resumes from its newest checkpoint."""
    job = ProcessJob(t or chaos_topology(), run_dir)
    out = Outcome("kill -9 the PS, start the job again (processes)", False, None, None, None)
    limit = job.t.ps.rpc_timeout + 10
    try:
        job.start()
        wait_until("a checkpoint at version >= 200",
                   lambda: [r for r in job.events("ps", "checkpoint") if r["step"] >= 200], RUN_TIMEOUT)
        start, wall = job.signal("ps", signal.SIGKILL), time.time()
        workers = [n for n in job.procs if n != "ps"]
        exits = {}
        for name in workers:
            code = job.wait_exit(name, max(0.1, start + limit - time.monotonic()))
            exits[name] = (code, round(time.monotonic() - start, 2))
        out.detected_s = max(s for _, s in exits.values())
        out.details["worker_exits"] = exits
        if any(code == 0 for code, _ in exits.values()):
            out.notes = f"a worker exited 0 after the PS died: {exits}"
            return out
        job.wait_exit("ps", 10)
        job.start()
        resume = wait_until("the PS resumes", lambda: job.events("ps", "resume", wall), RUN_TIMEOUT)
        push = wait_until("a worker trains again",
                          lambda: [r for n in workers for r in job.events(n, "train", resume[0]["time"])], RUN_TIMEOUT)
        out.recovered_s = min(r["time"] for r in push) - wall
        out.details.update(resumed_version=resume[0]["step"], resumed_from=resume[0]["checkpoint"])
        out.notes = (f"workers exited {sorted({c for c, _ in exits.values()})} within {out.detected_s:.1f} s; "
                     f"resumed from version {resume[0]['step']}")
        return _finish(job, out, lambda: resume[0]["step"] > 0)
    except Timeout as error:
        out.notes = str(error)
        return out
    finally:
        job.close()


def checkpoint_kill_loop(run_dir: Path, rounds: int = 10) -> Outcome:
    """kill -9 in the middle of checkpoint writes, again and again (orchestrator/chaos_checkpoints.py)."""
    from orchestrator.chaos_checkpoints import kill_loop
    return kill_loop(run_dir, rounds)


PROCESS_SCENARIOS: dict[str, Callable[[Path], Outcome]] = {
    "worker-kill": worker_kill,
    "worker-freeze": worker_freeze,
    "ps-kill": ps_kill,
    "checkpoint-kill": checkpoint_kill_loop,
}


def table(outcomes: list[Outcome]) -> list[str]:
    def secs(v: Optional[float]) -> str:
        return "-" if v is None else f"{v:.1f} s"

    rows = [("FAULT", "RECOVERED", "DETECTED", "RECOVERED IN", "ACCURACY", "NOTES")]
    for o in outcomes:
        rows.append((o.fault, "yes" if o.recovered else "NO", secs(o.detected_s), secs(o.recovered_s),
                     "-" if o.accuracy is None else f"{o.accuracy:.4f}", o.notes))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    return ["  ".join(c.ljust(w) for c, w in zip(r[:5], widths)) + "  " + r[5] for r in rows]


def run(names: list[str], run_root: Path, containers: bool, out: TextIO = sys.stdout) -> int:
    """Run the named scenarios (all by default); print the table; 0 when all recovered."""
    scenarios: dict[str, Callable[[Path], Outcome]] = dict(PROCESS_SCENARIOS)
    if containers:
        from orchestrator import chaos_containers
        scenarios.update(chaos_containers.SCENARIOS)
    outcomes = []
    for name in names or list(scenarios):
        if name not in scenarios:
            print(f"chaos: unknown scenario {name!r}; known: {', '.join(scenarios)}", file=out)
            return 2
        print(f"==> chaos: {name}", file=out, flush=True)
        run_dir = run_root / name
        start = time.monotonic()
        outcome = scenarios[name](run_dir)
        print(f"    {'recovered' if outcome.recovered else 'NOT recovered'} in {time.monotonic() - start:.0f} s: "
              f"{outcome.notes} (logs and metrics in {run_dir})", file=out, flush=True)
        outcomes.append(outcome)
    print(file=out)
    for line in table(outcomes):
        print(line, file=out)
    return 0 if all(o.recovered for o in outcomes) else 1
