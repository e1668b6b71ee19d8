"""Chaos scenarios as local processes: the PS and workers of the chaos topology
started one by one (`ProcessJob`) and hit.

The faults every target runs (chaos.faults: kill -9 a worker, the PS, a PS shard), here with
each process that fails started again as compose's `restart: on-failure` does; and SIGSTOP a
worker (frozen) and SIGCONT it. The failure tests (tests/failure/) run the same scenarios and
assert on their details.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Optional

from app.contract import Event
from orchestrator import job_secret, runs
from orchestrator.chaos import faults
from orchestrator.chaos.common import POLL, RUN_TIMEOUT, Outcome, Scenario, Timeout, chaos_topology, wait_until
from orchestrator.chaos.faults import Job
from orchestrator.metrics.records import Record, events, read_jsonl
from orchestrator.topology.model import Topology
from orchestrator.topology.services import PS_SERVICE, by_name
from orchestrator.verbs.local import (
    app_argv,
    free_port,
    loopback_ifname,
    service_environment,
    shm_dir,
    spawn,
)

RESTART_DELAY_SECONDS = 0.5
NOT_RESTARTED = (0, 2)  # a clean exit, and a mistake in the input (app/stops.py), as the local run's supervisor


class ProcessJob:
    """The PS and workers of a topology as local processes, started and hit one by one: one
    run (one run id), so a PS started again resumes, as a restarted container does. With
    `restart`, a process that fails is started again (after RESTART_DELAY_SECONDS), as compose's
    `restart: on-failure` does: a thread watches them (chaos.faults.Job)."""

    def __init__(self, t: Topology, run_dir: Path, restart: bool = False) -> None:
        self.t, self.run_dir = t, run_dir
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)  # the run's directory, before its secret goes there
        self.run_id = runs.new_id()
        self.port = free_port()
        self.ifname = loopback_ifname()
        self._exchange = job_secret.private_exchange(run_dir)
        self.exchange = self._exchange.__enter__()  # the run's secret and sockets, until close()
        self.procs: dict[str, subprocess.Popen] = {}
        self.starts: dict[str, int] = {}
        self.failed: list[tuple[str, int, float]] = []  # (name, exit status, unix time seen), in order
        self._lock = threading.RLock()
        self._closed = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="chaos-restarts", daemon=True) if restart else None
        if self._watcher is not None:
            self._watcher.start()

    def start(self, *names: str) -> None:
        """Start `names` (all by default). With the PS among them, the others start once its
        store accepts connections, as compose starts workers once the PS is healthy: a worker
        started beside a PS that is still importing torch on a loaded host would otherwise spend
        its --rpc_timeout (10 s here) waiting for it, and exit 1."""
        known = by_name(self.t)
        chosen = list(names or known)
        if PS_SERVICE in chosen and len(chosen) > 1:
            self.start(PS_SERVICE)
            wait_until("the PS listens", self._ps_listens, RUN_TIMEOUT)
            chosen.remove(PS_SERVICE)
        for name in chosen:
            service = known[name]
            env = service_environment(
                self.t,
                service,
                port=self.port,
                run_dir=self.run_dir,
                ifname=self.ifname,
                run_id=self.run_id,
                exchange=self.exchange,
            )
            with self._lock:
                n = self.starts[name] = self.starts.get(name, 0) + 1
                with (
                    open(self.run_dir / "logs" / f"{name}.{n}.out", "w") as out,
                    open(self.run_dir / "logs" / f"{name}.{n}.err", "w") as err,
                ):
                    self.procs[name] = spawn(app_argv(service.role), env, stdout=out, stderr=err)

    def _watch(self) -> None:
        """Start each process that failed again (restart: on-failure), once per failure."""
        seen: set[int] = set()  # the pids whose end was handled
        while not self._closed.wait(POLL):
            with self._lock:
                ended = [(n, p) for n, p in self.procs.items() if p.poll() is not None and p.pid not in seen]
                for name, proc in ended:
                    seen.add(proc.pid)
                    if proc.returncode not in NOT_RESTARTED:
                        self.failed.append((name, proc.returncode, time.time()))
            for name, proc in ended:
                if proc.returncode not in NOT_RESTARTED and not self._closed.wait(RESTART_DELAY_SECONDS):
                    self.start(name)

    # The blocks of chaos.faults.Job.

    def kill(self, name: str) -> float:
        """SIGKILL `name`; the unix time just before."""
        sent = time.time()
        self.signal(name, signal.SIGKILL)
        return sent

    def restarts(self, name: str) -> int:
        return max(0, self.starts.get(name, 0) - 1)

    def failures(self, since: float) -> dict[str, tuple[Optional[int], float]]:
        """Each process seen failing after `since` (unix time): its first such exit status and when."""
        out: dict[str, tuple[Optional[int], float]] = {}
        with self._lock:
            for name, code, seen in self.failed:
                if seen >= since and name not in out:
                    out[name] = (code, seen)
        return out

    def ended(self, timeout: float = RUN_TIMEOUT) -> dict[str, int]:
        """Every process's exit status once all have ended and none is to be started again."""

        def done() -> Optional[dict[str, int]]:
            with self._lock:
                codes = {n: p.poll() for n, p in self.procs.items()}
            if any(c is None for c in codes.values()):
                return None
            restarting = self._watcher is not None and any(c not in NOT_RESTARTED for c in codes.values())
            return None if restarting else {n: int(c) for n, c in codes.items() if c is not None}

        return wait_until("every process ended", done, timeout)

    def _ps_listens(self) -> bool:
        if self.procs[PS_SERVICE].poll() is not None:
            raise Timeout(f"the PS exited ({self.procs[PS_SERVICE].returncode}) before it listened")
        try:
            with socket.socket(socket.AF_UNIX) as probe:
                probe.settimeout(1)
                probe.connect(str(Path(self.exchange[job_secret.SOCKET_DIR_ENV]) / f"{PS_SERVICE}.sock"))
        except OSError:
            return False
        return True

    def signal(self, name: str, sig: int) -> float:
        self.procs[name].send_signal(sig)
        return time.monotonic()

    def wait_exit(self, name: str, timeout: float) -> int:
        try:
            return self.procs[name].wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise Timeout(f"{name} did not exit within {timeout:.0f} s") from None

    def events(self, name: str, event: Event, since: float = 0.0) -> list[Record]:
        """Metrics records of one process (`ps`, `worker2`) with this event, written after `since` (unix time)."""
        return events(read_jsonl(self.run_dir / "metrics" / by_name(self.t)[name].metrics_file), event, since)

    def log(self, name: str, n: int = 1) -> str:
        return (self.run_dir / "logs" / f"{name}.{n}.err").read_text(encoding="utf-8", errors="replace")

    def close(self) -> None:
        self._closed.set()
        if self._watcher is not None:
            self._watcher.join(timeout=RESTART_DELAY_SECONDS + 5)
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        shutil.rmtree(shm_dir(self.t, self.run_id), ignore_errors=True)
        self._exchange.__exit__(None, None, None)


def _run(fault: str, strike: Callable[[Job, Outcome], Outcome], run_dir: Path, t: Optional[Topology]) -> Outcome:
    """`strike` a job of `t` whose processes are started again when they fail."""
    job = ProcessJob(t or chaos_topology(), run_dir, restart=True)
    out = Outcome(fault)
    try:
        job.start()
        return strike(job, out)
    except Timeout as error:
        out.notes = str(error)
        return out
    finally:
        job.close()


def worker_kill(run_dir: Path, t: Optional[Topology] = None, victim: str = "worker2") -> Outcome:
    """chaos.faults.worker_kill as processes."""
    fault = "kill -9 a worker, started again (processes)"
    return _run(fault, lambda job, out: faults.worker_kill(job, out, victim), run_dir, t)


def ps_kill(run_dir: Path, t: Optional[Topology] = None) -> Outcome:
    """chaos.faults.ps_kill as processes."""
    return _run("kill -9 the PS, started again (processes)", faults.ps_kill, run_dir, t)


def ps_shard_kill(run_dir: Path, t: Optional[Topology] = None) -> Outcome:
    """chaos.faults.ps_shard_kill as processes."""
    fault = "kill -9 a PS shard (ps.shards: 2), started again (processes)"
    return _run(fault, faults.ps_shard_kill, run_dir, faults.sharded(t))


def worker_freeze(run_dir: Path, t: Optional[Topology] = None, victim: str = "worker2") -> Outcome:
    """SIGSTOP a worker: the PS drops it at the RPC timeout and trains on. SIGCONT: if its
    own call to the PS timed out meanwhile it exits 1 and is started again (as compose's
    restart does) and rejoins; if not, the PS readmits it when it calls again."""
    job = ProcessJob(t or chaos_topology(), run_dir)
    out = Outcome("freeze a worker (SIGSTOP) past the RPC timeout, thaw it")
    try:
        job.start()
        wait_until(f"{victim} at epoch 5", lambda: faults.training(job, victim, 5), RUN_TIMEOUT)
        job.signal(victim, signal.SIGSTOP)
        wall = time.time()
        drop = wait_until(
            "the PS drops it", lambda: job.events(PS_SERVICE, Event.DROP, wall), job.t.ps.rpc_timeout + 15
        )
        out.detected_s = drop[0]["time"] - wall
        job.signal(victim, signal.SIGCONT)
        code = job.wait_exit(victim, RUN_TIMEOUT)
        if code == 0:
            back = wait_until("it is readmitted", lambda: job.events(PS_SERVICE, Event.BACK, wall), 1)
            out.notes = "thawed, it called again and was readmitted"
        else:
            job.start(victim)
            back = wait_until("it rejoins", lambda: job.events(PS_SERVICE, Event.JOIN, wall), RUN_TIMEOUT)
            out.notes = f"thawed, its timed-out call made it exit {code}; started again, {back[0]['worker']} rejoined"
        out.recovered_s = back[0]["time"] - wall
        out.notes = f"dropped after {out.detected_s:.1f} s (rpc_timeout {job.t.ps.rpc_timeout} s); " + out.notes
        return faults.judge(job, out)
    except Timeout as error:
        out.notes = str(error)
        return out
    finally:
        job.close()


SCENARIOS: dict[str, Scenario] = {
    "worker-kill": worker_kill,
    "worker-freeze": worker_freeze,
    "ps-kill": ps_kill,
    "ps-shard-kill": ps_shard_kill,
}
