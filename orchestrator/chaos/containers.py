"""The chaos scenarios in real containers (the offline cpu-smoke image, compose).

The faults every target runs (chaos.faults), on a compose project (`ContainerJob`), and what
only containers have: `make down` mid-run and `make up RESUME=1`, and `make scale`.

A crash is simulated by SIGKILL of the app process inside the container (what
the kernel's OOM killer or a segfault does): the container exits 137 and
Docker applies its restart policy (`restart: on-failure`). `docker kill`
would not do: Docker counts it as a manual stop and never restarts the
container after it (checked on Docker 20.10).
"""

from __future__ import annotations

import dataclasses
import io
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

from app.contract import Event
from orchestrator import images, runs
from orchestrator.backends import command
from orchestrator.backends.compose import adapter
from orchestrator.backends.compose.backend import SCALE_STOP_SECONDS
from orchestrator.backends.compose.status import service_states
from orchestrator.chaos import faults
from orchestrator.chaos.common import RUN_TIMEOUT, Outcome, Scenario, Timeout, chaos_topology, wait_until
from orchestrator.chaos.faults import sharded
from orchestrator.metrics.records import Record, events, parse_lines
from orchestrator.paths import ROOT
from orchestrator.render import compose
from orchestrator.render.yamlio import write_atomic
from orchestrator.topology.model import Topology
from orchestrator.topology.services import PS_SERVICE, by_name, service_names
from orchestrator.verbs import scaling


# Run inside a container (as its user): send a signal (SIGKILL unless said) to the `python -m app
# ROLE` process of that container. Its cgroup tells it from the other containers' processes, which
# it also sees when the job's containers share one PID namespace (network.same_host_copy).
def signal_app_code(signal_name: str = "SIGKILL") -> str:
    """The Python source that sends `signal_name` to the app process of the container it runs in."""
    return (
        "import os, signal\n"
        "own = open('/proc/self/cgroup').read()\n"
        "for pid in filter(str.isdigit, os.listdir('/proc')):\n"
        "    try:\n"
        "        argv = open(f'/proc/{pid}/cmdline', 'rb').read().split(b'\\0')\n"
        "        cgroup = open(f'/proc/{pid}/cgroup').read()\n"
        "    except OSError:\n"
        "        continue\n"
        "    if argv[1:3] == [b'-m', b'app'] and int(pid) != os.getpid() and cgroup == own:\n"
        f"        os.kill(int(pid), signal.{signal_name})\n"
    )


KILL_APP = signal_app_code("SIGKILL")


class ContainerJob:
    """One compose project of the chaos topology, on the real engine."""

    def __init__(self, t: Topology, project: str) -> None:
        self.t, self.client, self.compose = t, images.client(), adapter.detect()
        self._failed: dict[str, tuple[Optional[int], float]] = {}  # name -> (status, unix time first seen failing)
        self.tmp = Path(tempfile.mkdtemp(prefix=f"{project}-"))
        self.project = adapter.Project(project, str(self.tmp / "compose.yaml"), str(ROOT))
        write_atomic(self.project.file, compose.dump(compose.render(t), t.name))

    def up(self, resume: bool = False) -> None:
        """`make up` (`resume`: `make up RESUME=1`): a new run, with its own id."""
        command.run(
            adapter.up_argv(self.compose, self.project), capture=True, env=runs.environment(runs.new_id(), resume)
        )

    def down(self, volumes: bool) -> float:
        start = time.monotonic()
        command.run(adapter.down_argv(self.compose, self.project, volumes=volumes), capture=True, check=False)
        return time.monotonic() - start

    def close(self) -> None:
        self.down(volumes=True)
        shutil.rmtree(self.tmp, ignore_errors=True)

    def containers(self) -> dict[str, Any]:
        found = adapter.containers(self.client, self.project.name)
        return {c.labels.get(adapter.LABEL_SERVICE, c.name): c for c in found}

    def states(self) -> dict[str, dict[str, Any]]:
        out = {}
        for service, c in self.containers().items():
            c.reload()
            state = c.attrs["State"]
            out[service] = {
                "status": state["Status"],
                "exit_code": state["ExitCode"],
                "restarts": c.attrs["RestartCount"],
            }
        return out

    def kill_app(self, service: str) -> float:
        """SIGKILL the app process of `service`'s container; the time just before (what the
        kill sets off, a drop or a lost shard, may be recorded before the exec returns). The
        exec is detached: its container restarts under it, and the engine once left the wait
        for its output open for good (a 600 s test timeout on a loaded 2-core CPU VM)."""
        sent = time.time()
        self.containers()[service].exec_run(["python", "-c", KILL_APP], detach=True)
        return sent

    # The blocks of chaos.faults.Job.

    def kill(self, name: str) -> float:
        return self.kill_app(name)

    def restarts(self, name: str) -> int:
        return int(self.states().get(name, {}).get("restarts", 0))

    def failures(self, since: float) -> dict[str, tuple[Optional[int], float]]:
        """Each container seen failing (restarted, or exited non-zero), first seen after `since`."""
        now = time.time()
        for name, s in self.states().items():
            if name not in self._failed and (s["restarts"] >= 1 or (s["status"] == "exited" and s["exit_code"])):
                self._failed[name] = (s["exit_code"] or None, now)
        return {name: f for name, f in self._failed.items() if f[1] >= since}

    def ended(self, timeout: float = RUN_TIMEOUT) -> dict[str, int]:
        return {name: s["exit_code"] for name, s in self.wait_done(timeout).items()}

    def events(self, name: str, event: Event, since: float = 0.0) -> list[Record]:
        files = adapter.read_metrics(self.client, self.project.name, list(self.containers().values()))
        known = by_name(self.t)  # a worker above workers.count (scaled up) writes <name>.jsonl too
        file = known[name].metrics_file if name in known else f"{name}.jsonl"
        return events(parse_lines(files.get(file, [])), event, since)

    def wait_done(self, timeout: float = RUN_TIMEOUT) -> dict[str, dict[str, Any]]:
        """Every container exited and stays so (not restarting)."""
        expected = set(service_names(self.t))

        def done() -> Optional[dict[str, dict[str, Any]]]:
            s = self.states()
            # workers above workers.count (started by a scale) are among them
            return s if expected <= set(s) and all(v["status"] == "exited" for v in s.values()) else None

        return wait_until("every container exited", done, timeout)

    def scale(self, workers: int) -> tuple[list[str], list[str]]:
        """`make scale WORKERS=workers` on this project: (services started, services stopped)."""
        running = scaling.running_workers(service_states([c.attrs for c in self.containers().values()]))
        if running is None:
            raise Timeout("scale: the PS is not running")
        start, stop = scaling.scale_plan(running, workers)
        if start:
            env = adapter.running_env(self.client, self.project.name, runs.VARIABLES)
            command.run(adapter.start_services_argv(self.compose, self.project, start), capture=True, env=env)
        if stop:
            command.run(adapter.stop_argv(self.compose, self.project, stop, SCALE_STOP_SECONDS), capture=True)
        return start, stop

    def logs(self) -> str:
        return "".join(f"----- {s}\n" + c.logs().decode("utf-8", "replace") for s, c in self.containers().items())


def _scenario(
    fault: str,
    project: str,
    body: Callable[[ContainerJob, Outcome], Outcome],
    run_dir: Path,
    t: Optional[Topology] = None,
) -> Outcome:
    t = t or chaos_topology()
    base, pip_source = images.source(t, offline=True)
    images.build(t.image_tag, base, pip_source, out=io.StringIO())
    # A project of its own (the scenario's name and 6 random hex digits): two chaos runs on one
    # engine never share, nor remove, each other's containers and volume.
    job = ContainerJob(t, f"{project}-{secrets.token_hex(3)}")
    out = Outcome(fault)
    try:
        job.up()
        return body(job, out)
    except Timeout as error:
        out.notes = str(error)
        return out
    finally:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "containers.log").write_text(job.logs(), encoding="utf-8")
        job.close()


def worker_kill(run_dir: Path, t: Optional[Topology] = None, victim: str = "worker2") -> Outcome:
    """chaos.faults.worker_kill in containers: Docker starts the killed worker again."""
    fault = "kill the app in a worker container (Docker restarts it)"
    return _scenario(fault, "psc-chaos-worker", lambda job, out: faults.worker_kill(job, out, victim), run_dir, t)


def ps_kill(run_dir: Path, t: Optional[Topology] = None) -> Outcome:
    """chaos.faults.ps_kill in containers: Docker starts the PS and the workers again."""
    fault = "kill the app in the PS container (Docker restarts it)"
    return _scenario(fault, "psc-chaos-ps", faults.ps_kill, run_dir, t)


def stop_and_up(run_dir: Path, t: Optional[Topology] = None) -> Outcome:
    """`make down` mid-run (SIGTERM): it stops in seconds, the PS checkpoints on the way
    out; `make up RESUME=1` resumes from that checkpoint and finishes."""

    def body(job: ContainerJob, out: Outcome) -> Outcome:
        faults.wait_mid_run(job)
        wall = time.time()
        out.detected_s = job.down(volumes=False)
        job.up(resume=True)
        resume = wait_until("the PS resumes", lambda: job.events(PS_SERVICE, Event.RESUME, wall), RUN_TIMEOUT)
        on_exit = [r for r in job.events(PS_SERVICE, Event.CHECKPOINT, wall - 60) if r.get("why") == "on exit"]
        out.recovered_s = resume[0]["time"] - wall
        out.details.update(down_s=out.detected_s, resumed_version=resume[0]["step"], on_exit=on_exit)
        out.notes = (
            f"down took {out.detected_s:.1f} s; checkpoint on SIGTERM at version "
            f"{on_exit[-1]['step'] if on_exit else '?'}; resumed from version {resume[0]['step']}"
        )
        return faults.judge(job, out, lambda: bool(on_exit) and resume[0]["step"] == on_exit[-1]["step"])

    return _scenario("make down mid-run, make up RESUME=1", "psc-chaos-stop", body, run_dir, t)


def ps_shard_kill(run_dir: Path, t: Optional[Topology] = None) -> Outcome:
    """chaos.faults.ps_shard_kill in containers: Docker starts the shard again."""
    fault = "kill the app in a PS shard container (Docker restarts it)"
    return _scenario(fault, "psc-chaos-shard", faults.ps_shard_kill, run_dir, sharded(t))


def sharded_stop_and_up(run_dir: Path, t: Optional[Topology] = None) -> Outcome:
    """`make down` of a sharded PS mid-run: compose stops the shards before the PS, and every
    slice is written on the way out; `make up RESUME=1` continues from there."""

    def body(job: ContainerJob, out: Outcome) -> Outcome:
        faults.wait_mid_run(job)
        wall = time.time()
        out.detected_s = job.down(volumes=False)
        job.up(resume=True)
        resume = wait_until("the PS resumes", lambda: job.events(PS_SERVICE, Event.RESUME, wall), RUN_TIMEOUT)
        on_exit = [r for r in job.events(PS_SERVICE, Event.CHECKPOINT, wall - 60) if r.get("why") == "on exit"]
        out.recovered_s = resume[0]["time"] - wall
        out.details.update(down_s=out.detected_s, resumed_version=resume[0]["step"], on_exit=on_exit)
        out.notes = (
            f"down took {out.detected_s:.1f} s; on SIGTERM the PS wrote version "
            f"{on_exit[-1]['step'] if on_exit else '?'} and the shard its slice; resumed from version "
            f"{resume[0]['step']}"
        )
        return faults.judge(job, out, lambda: bool(on_exit) and resume[0]["step"] == on_exit[-1]["step"])

    return _scenario(
        "make down of a sharded PS mid-run, make up RESUME=1", "psc-chaos-sharded-stop", body, run_dir, sharded(t)
    )


def scalable(t: Optional[Topology] = None, most: int = 4) -> Topology:
    """The chaos topology (2 workers) that may grow to `most` workers while it runs."""
    t = t or chaos_topology(workers=2)
    # long enough for the new workers to start (~10 s each on a 2-core CPU VM) and train a while
    train = dataclasses.replace(t.train, epochs=100)
    return t.model_copy(update={"train": train, "workers": t.workers.model_copy(update={"max": most})})


def scale(run_dir: Path, t: Optional[Topology] = None) -> Outcome:
    """`make scale` 2 -> 4 -> 2 workers mid-run: the new ranks join the running job and train;
    the highest two then get SIGTERM, leave cleanly (a `left` record each, no drop) and exit 0,
    and the run finishes with every container exited 0."""

    def body(job: ContainerJob, out: Outcome) -> Outcome:
        wait_until(
            "worker1 at epoch 3", lambda: any(r["epoch"] >= 3 for r in job.events("worker1", Event.TRAIN)), RUN_TIMEOUT
        )
        wall = time.time()
        started, _ = job.scale(4)

        def joined() -> list[Record]:
            found = job.events(PS_SERVICE, Event.JOIN, wall)
            return found if {r["worker"] for r in found} >= {"worker3", "worker4"} else []

        joins = wait_until("worker3 and worker4 join", joined, RUN_TIMEOUT)
        out.detected_s = max(r["time"] for r in joins) - wall
        wait_until(
            "worker3 and worker4 train",
            lambda: all(len(job.events(w, Event.TRAIN, wall)) >= 3 for w in ("worker4", "worker3")),
            RUN_TIMEOUT,
        )
        down = time.time()
        _, stopped = job.scale(2)

        def gone() -> list[Record]:
            found = job.events(PS_SERVICE, Event.LEFT, down)
            return found if len(found) >= 2 else []

        left = wait_until("worker3 and worker4 leave", gone, RUN_TIMEOUT)
        out.recovered_s = max(r["time"] for r in left) - wall
        drops = job.events(PS_SERVICE, Event.DROP, wall)
        out.details.update(
            started=started,
            stopped=stopped,
            joins=[(r["worker"], r["step"], r.get("workers")) for r in joins],
            left=[(r["worker"], r["step"], r.get("workers")) for r in left],
            drops=len(drops),
        )
        out.notes = (
            "joined "
            + ", ".join(f"{r['worker']} at version {r['step']}" for r in joins)
            + "; left "
            + ", ".join(f"{r['worker']} at version {r['step']}" for r in left)
        )
        return faults.judge(
            job,
            out,
            lambda: (
                not drops
                and all(job.restarts(w) == 0 for w in ("worker3", "worker4"))
                and {r["worker"] for r in left} == {"worker3", "worker4"}
            ),
        )

    return _scenario("make scale 2 -> 4 -> 2 workers mid-run", "psc-chaos-scale", body, run_dir, scalable(t))


SCENARIOS: dict[str, Scenario] = {
    "container-worker-kill": worker_kill,
    "container-ps-kill": ps_kill,
    "container-stop-up": stop_and_up,
    "container-ps-shard-kill": ps_shard_kill,
    "container-sharded-stop-up": sharded_stop_and_up,
    "scale": scale,
}
