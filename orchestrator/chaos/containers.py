"""The chaos scenarios in real containers (the offline cpu-smoke image, compose).

The faults every target runs (chaos.faults), on a compose project (`ContainerJob`), and what
only containers have: `make down` mid-run and `make up RESUME=1`, and `make scale`.

A crash is SIGKILL of the app process inside the container (the compose target's
`signal_app`, orchestrator/backends/compose/app_signal.py): the container exits 137 and
Docker applies its restart policy (`restart: on-failure`).
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
from orchestrator.backends.base import Cluster
from orchestrator.backends.compose import adapter
from orchestrator.backends.registry import COMPOSE
from orchestrator.backends.target_run import TargetRun
from orchestrator.chaos import faults
from orchestrator.chaos.common import RUN_TIMEOUT, Outcome, Scenario, Timeout, chaos_topology, wait_until
from orchestrator.chaos.faults import sharded
from orchestrator.metrics.records import Record
from orchestrator.paths import ROOT
from orchestrator.topology.model import Topology
from orchestrator.topology.services import PS_SERVICE
from orchestrator.verbs import scaling


class ContainerJob(TargetRun):
    """One compose project of the chaos topology, on the real engine, through the compose
    target's blocks; and what the tests and the soak read of its containers."""

    def __init__(self, t: Topology, project: str) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix=f"{project}-"))
        super().__init__(COMPOSE, t, Cluster(project, self.tmp / COMPOSE.output, topology=t))
        self.client = images.client()
        self.project = adapter.Project(project, str(self.c.file), str(ROOT))

    def close(self) -> None:
        try:
            self.down(volumes=True)
        finally:
            shutil.rmtree(self.tmp, ignore_errors=True)

    def containers(self) -> dict[str, Any]:
        found = adapter.containers(self.client, self.project.name)
        return {c.labels.get(adapter.LABEL_SERVICE, c.name): c for c in found}

    def states(self) -> dict[str, dict[str, Any]]:
        """{service: {status, exit_code, restarts}}, as the soak's checks and records keep them."""
        return {
            name: {"status": s.status, "exit_code": s.exit_code, "restarts": s.restarts}
            for name, s in self.service_states().items()
        }

    def scale(self, workers: int) -> tuple[list[str], list[str]]:
        """`make scale WORKERS=workers` on this project: (services started, services stopped)."""
        running = scaling.running_workers(self.backend.describe(self.c))
        if running is None:
            raise Timeout("scale: the PS is not running")
        start, stop = scaling.scale_plan(running, workers)
        self.backend.scale_to(self.c, start, stop, self.backend.running_env(self.c, runs.VARIABLES))
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
