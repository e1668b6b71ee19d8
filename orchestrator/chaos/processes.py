"""Chaos scenarios as local processes: the PS and workers of the chaos topology
started one by one (`ProcessJob`) and hit.

kill -9 a worker and start it again; SIGSTOP a worker (frozen) and SIGCONT it;
kill -9 the PS, then restart everything. The failure tests (tests/failure/)
run the same scenarios and assert on their details.
"""

from __future__ import annotations

import dataclasses
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Optional

from app.contract import Event
from orchestrator import job_secret, runs
from orchestrator.chaos.common import (
    CHECKPOINT_VERSION,
    RUN_TIMEOUT,
    THRESHOLD,
    Outcome,
    Scenario,
    Timeout,
    chaos_topology,
    wait_until,
)
from orchestrator.metrics.records import Record, events, read_jsonl
from orchestrator.topology.model import Topology
from orchestrator.topology.services import PS_SERVICE, by_name, shard_service
from orchestrator.verbs.local import (
    app_argv,
    free_port,
    loopback_ifname,
    service_environment,
    shm_dir,
    spawn,
)


class ProcessJob:
    """The PS and workers of a topology as local processes, started and hit one by one: one
    run (one run id), so a PS started again resumes, as a restarted container does."""

    def __init__(self, t: Topology, run_dir: Path) -> None:
        self.t, self.run_dir = t, run_dir
        self.run_id = runs.new_id()
        self.port = free_port()
        self.ifname = loopback_ifname()
        self._exchange = job_secret.private_exchange(run_dir)
        self.exchange = self._exchange.__enter__()  # the run's secret and sockets, until close()
        self.procs: dict[str, subprocess.Popen] = {}
        self.starts: dict[str, int] = {}
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)

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
            n = self.starts[name] = self.starts.get(name, 0) + 1
            with (
                open(self.run_dir / "logs" / f"{name}.{n}.out", "w") as out,
                open(self.run_dir / "logs" / f"{name}.{n}.err", "w") as err,
            ):
                self.procs[name] = spawn(app_argv(service.role), env, stdout=out, stderr=err)

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

    def wait_all(self, timeout: float = RUN_TIMEOUT) -> dict[str, int]:
        deadline = time.monotonic() + timeout
        return {n: self.wait_exit(n, max(0.1, deadline - time.monotonic())) for n in list(self.procs)}

    def events(self, name: str, event: Event, since: float = 0.0) -> list[Record]:
        """Metrics records of one process (`ps`, `worker2`) with this event, written after `since` (unix time)."""
        return events(read_jsonl(self.run_dir / "metrics" / by_name(self.t)[name].metrics_file), event, since)

    def log(self, name: str, n: int = 1) -> str:
        return (self.run_dir / "logs" / f"{name}.{n}.err").read_text(encoding="utf-8", errors="replace")

    def close(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        shutil.rmtree(shm_dir(self.t, self.run_id), ignore_errors=True)
        self._exchange.__exit__(None, None, None)


def _accuracy(job: ProcessJob) -> Optional[float]:
    ends = job.events(PS_SERVICE, Event.END)
    return ends[-1]["accuracy"] if ends else None


def _training(job: ProcessJob, worker: str, epoch: int) -> bool:
    return any(r["epoch"] >= epoch for r in job.events(worker, Event.TRAIN))


def _wait_mid_run(job: ProcessJob) -> None:
    """Until every worker trains and the PS has a checkpoint at version >= CHECKPOINT_VERSION:
    the PS scenarios strike a job in full swing. On a loaded host one worker can still be
    starting (importing torch, loading its shard) when the others have pushed that far, and a
    PS killed then meets it in its store handshake, not mid-push."""
    workers = [n for n in job.procs if by_name(job.t)[n].role == "worker"]
    wait_until("every worker trains", lambda: all(_training(job, w, 0) for w in workers), RUN_TIMEOUT)
    wait_until(
        f"a checkpoint at version >= {CHECKPOINT_VERSION}",
        lambda: [r for r in job.events(PS_SERVICE, Event.CHECKPOINT) if r["step"] >= CHECKPOINT_VERSION],
        RUN_TIMEOUT,
    )


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
    out = Outcome("kill -9 a worker, start it again (processes)")
    try:
        job.start()
        wait_until(f"{victim} at epoch 5", lambda: _training(job, victim, 5), RUN_TIMEOUT)
        job.signal(victim, signal.SIGKILL)
        wall = time.time()
        job.wait_exit(victim, 10)
        drop = wait_until(
            "the PS drops it", lambda: job.events(PS_SERVICE, Event.DROP, wall), job.t.ps.rpc_timeout + 10
        )
        out.detected_s = drop[0]["time"] - wall
        job.start(victim)
        join = wait_until("it rejoins", lambda: job.events(PS_SERVICE, Event.JOIN, drop[0]["time"]), RUN_TIMEOUT)
        out.recovered_s = join[0]["time"] - wall
        out.details.update(drop=drop[0], rejoin=join[0], kill_time=wall)
        out.notes = f"{drop[0]['worker']} dropped, {join[0]['worker']} resumed at epoch {join[0]['epoch']}"

        def pushed_again() -> bool:
            after = [r for r in job.events(victim, Event.TRAIN) if r["time"] > join[0]["time"]]
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
    out = Outcome("freeze a worker (SIGSTOP) past the RPC timeout, thaw it")
    try:
        job.start()
        wait_until(f"{victim} at epoch 5", lambda: _training(job, victim, 5), RUN_TIMEOUT)
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
    out = Outcome("kill -9 the PS, start the job again (processes)")
    limit = job.t.ps.rpc_timeout + 10
    try:
        job.start()
        _wait_mid_run(job)
        start, wall = job.signal(PS_SERVICE, signal.SIGKILL), time.time()
        workers = [n for n in job.procs if n != PS_SERVICE]
        exits = {}
        for name in workers:
            code = job.wait_exit(name, max(0.1, start + limit - time.monotonic()))
            exits[name] = (code, round(time.monotonic() - start, 2))
        out.detected_s = max(s for _, s in exits.values())
        out.details["worker_exits"] = exits
        if any(code == 0 for code, _ in exits.values()):
            out.notes = f"a worker exited 0 after the PS died: {exits}"
            return out
        job.wait_exit(PS_SERVICE, 10)
        job.start()
        resume = wait_until("the PS resumes", lambda: job.events(PS_SERVICE, Event.RESUME, wall), RUN_TIMEOUT)
        push = wait_until(
            "a worker trains again",
            lambda: [r for n in workers for r in job.events(n, Event.TRAIN, resume[0]["time"])],
            RUN_TIMEOUT,
        )
        out.recovered_s = min(r["time"] for r in push) - wall
        out.details.update(resumed_version=resume[0]["step"], resumed_from=resume[0]["checkpoint"])
        out.notes = (
            f"workers exited {sorted({c for c, _ in exits.values()})} within {out.detected_s:.1f} s; "
            f"resumed from version {resume[0]['step']}"
        )
        return _finish(job, out, lambda: resume[0]["step"] > 0)
    except Timeout as error:
        out.notes = str(error)
        return out
    finally:
        job.close()


def ps_shard_kill(run_dir: Path, t: Optional[Topology] = None) -> Outcome:
    """kill -9 one PS shard (ps.shards: 2) mid-run, after a checkpoint: the PS notices it
    lost the shard, workers that lose it exit non-zero; the shard and those workers are
    started again (as compose's restart: on-failure does), the shard takes its slice back
    from its checkpoint labelled with the PS's version, and the run ends as usual."""
    base = t or chaos_topology()
    t = base.model_copy(update={"ps": dataclasses.replace(base.ps, shards=2)})
    job = ProcessJob(t, run_dir)
    shard = shard_service(1)
    out = Outcome("kill -9 a PS shard (ps.shards: 2), start it again (processes)")
    try:
        job.start()
        _wait_mid_run(job)
        job.signal(shard, signal.SIGKILL)
        wall = time.time()
        job.wait_exit(shard, 10)
        lost = wait_until(
            "the PS notices", lambda: job.events(PS_SERVICE, Event.SHARD_LOST, wall), job.t.ps.rpc_timeout + 10
        )
        out.detected_s = lost[0]["time"] - wall
        job.start(shard)
        workers = [n for n in job.procs if n not in (PS_SERVICE, shard)]
        restarted: list[str] = []

        def whole_again() -> list[Record]:
            for name in workers:  # restart: on-failure, once each
                if name not in restarted and job.procs[name].poll() not in (None, 0):
                    restarted.append(name)
                    job.start(name)
            back = job.events(PS_SERVICE, Event.SHARD, wall)
            trained = [r for n in workers for r in job.events(n, Event.TRAIN, back[0]["time"])] if back else []
            return trained

        trained = wait_until("the shard is back and workers train", whole_again, RUN_TIMEOUT)
        out.recovered_s = min(r["time"] for r in trained) - wall
        out.details.update(restarted=restarted, lost=lost[0])
        out.notes = (
            f"PS lost the shard after {out.detected_s:.1f} s; "
            f"{len(restarted)} worker(s) exited and were started again; the shard resumed its slice"
        )
        out.details["shard_resume"] = job.events(shard, Event.RESUME, wall)
        return _finish(job, out, lambda: bool(job.events(shard, Event.RESUME, wall)))
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
