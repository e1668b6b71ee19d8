"""`python -m orchestrator chaos soak`: a cpu-smoke-sized job in compose under random faults for
a set time, then the invariants checked on what it left, printed as a table.

The job: cpu-smoke's CNN on digits, 2 workers (up to 4 by scale), the PS in 2 shards, short
RPC and join timeouts, long enough to outlive the soak; its state volume a tmpfs of a fixed
size. Once it has checkpointed, the faults of the plan (soak_plan, from the seed) follow one
another until the time is up; then the job is left to finish, and the invariants
(soak_checks) are judged on its records, the checkpoint audits taken before and after each
fault, the containers' end states and what is left on the engine after `down -v`.

Each soak is a compose project of its own (psc-soak-<6 hex digits>), so soaks side by side on
one engine never touch each other's cluster or volume; `--name` gives it a name instead, which
is refused while anything of that project is on the engine (the soak ends with `down -v`).
`--seeds K` runs K soaks one after another, each with a seed of its own, then one table.
"""

from __future__ import annotations

import dataclasses
import io
import json
import secrets
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional, TextIO

from app.contract import Event
from orchestrator import images, runs
from orchestrator.backends.compose import adapter
from orchestrator.chaos import soak_checks as checks
from orchestrator.chaos.common import THRESHOLD, chaos_topology
from orchestrator.chaos.soak_checks import Audit, FaultResult, Row, Shm
from orchestrator.chaos.soak_faults import FAULTS, Context, wait_for
from orchestrator.chaos.soak_job import SoakJob
from orchestrator.chaos.soak_plan import job_epochs, new_seed, schedule
from orchestrator.errors import UsageError
from orchestrator.metrics.records import Record, events
from orchestrator.topology.model import Topology
from orchestrator.topology.services import PS_SERVICE

PROJECT_PREFIX = "psc-soak"  # each soak's project: PROJECT_PREFIX-<6 hex digits>, unless named
VOLUME_MB = 64  # the state volume: checkpoints (~0.1 MB each), metrics and event files, with room to fill
# Each worker's container is held to WORKER_CPUS (compose's `cpus`): the job's pace then has a
# ceiling that more or idle cores do not raise, so a job sized to outlive the faults on a quiet
# host does not also train for minutes past them where it runs slower (beside other work, as in
# CI). Held so, on a 2-core CPU VM, cpu-smoke in this topology trains ~53 epochs a minute
# undisturbed (39 updates/s, 0.6 cores; unheld: ~190 epochs a minute on 1.7 cores) and ~38 a
# minute under a quiet soak's faults: a job of 75 a minute of faults outlives them twice over.
# A 3-minute soak alone there: 274 CPU-s instead of 582, its job 6.2 min instead of 5.6.
WORKER_CPUS = 0.2
EPOCHS_PER_MINUTE = 75
RECOVERY_S = 240.0  # a fault not recovered by then is reported so, and the soak goes on
WARM_UP_S = 300.0  # up to the first checkpoint
# After the faults, the job may take this many times the soak's minutes (+ 5 min) to finish: CI's
# 3-minute soak beside the rest of the suite took about 510 s of its 660 s at a factor of 2.
END_WAIT_FACTOR = 3.0


def own_project() -> str:
    """A project name no other soak has: the prefix and 6 random hex digits."""
    return f"{PROJECT_PREFIX}-{secrets.token_hex(3)}"


def soak_topology(minutes: float, epochs: Optional[int] = None, project: Optional[str] = None) -> Topology:
    """The chaos topology sized for a soak of `minutes`: every kind of fault has a target; named
    `project` (the image stays cpu-smoke's)."""
    t = chaos_topology(workers=2).with_name(project or own_project())
    train = dataclasses.replace(
        t.train, epochs=epochs or job_epochs(minutes, EPOCHS_PER_MINUTE), eval_every=200, log_every=50
    )
    ps = dataclasses.replace(t.ps, shards=2, checkpoint_every=200)
    workers = t.workers.model_copy(update={"max": 4})
    return t.model_copy(update={"train": train, "ps": ps, "workers": workers})


def refuse_taken(client: Any, project: str) -> None:
    """UsageError (one line) when a project named by --name is on the engine: live, or with
    containers or a volume that the soak's closing `down -v` would remove."""
    live = adapter.running_env(client, project, runs.VARIABLES)
    found = sorted(c.name for c in adapter.containers(client, project))
    volumes = sorted(v.name for v in client.volumes.list() if v.name.startswith(f"{project}_"))
    other = "give the soak another name (make soak NAME=..., --name), or none: each soak then has a project of its own"
    if live:
        raise UsageError(
            f"chaos soak: project {project} has a live run {live.get(runs.RUN_ID)} (containers: {' '.join(found)}); "
            + other
        )
    if found or volumes:
        raise UsageError(
            f"chaos soak: project {project} is on this engine ({' '.join(found + volumes)}), and the soak ends "
            f"with down -v, which would remove it; {other}"
        )


@dataclass
class Observed:
    """Everything the soak saw, filled in as it goes (an error stops it where it was)."""

    seed: int
    minutes: float
    faults: int = 0  # at least this many faults, past the minutes when recoveries are slow
    results: list[FaultResult] = field(default_factory=list)
    audits: list[Audit] = field(default_factory=list)
    ctx: Optional[Context] = None
    states: dict[str, dict[str, Any]] = field(default_factory=dict)
    shm_end: Optional[Shm] = None
    ps: list[Record] = field(default_factory=list)
    leftovers: dict[str, list[str]] = field(default_factory=dict)
    error: str = ""
    job_minutes: float = 0.0
    ended_early: Optional[float] = None  # the job ended this many minutes into the faults
    faults_minutes: float = 0.0  # how long the faults went on


def warm_up(job: SoakJob) -> None:
    """Until every worker of workers.count has joined and the PS has written a checkpoint."""

    def ready() -> bool:
        ps = job.records()
        joined = {r.get("worker_rank") for r in events(ps, Event.JOIN)}
        return joined >= set(range(1, job.t.workers.count + 1)) and bool(events(ps, Event.CHECKPOINT))

    if not wait_for(ready, WARM_UP_S):
        raise RuntimeError(f"the job did not start and checkpoint within {WARM_UP_S:.0f} s")


def inject(job: SoakJob, seen: Observed, out: TextIO) -> None:
    """The faults of the plan, one after the other, until the minutes have passed (and at least
    `seen.faults` were injected: a slow host's recoveries take longer) or the job ended."""
    assert seen.ctx is not None
    began = time.monotonic()
    end = began + seen.minutes * 60
    for step in schedule(seen.seed):
        injected = len([r for r in seen.results if not r.skipped])
        if time.monotonic() + step.pause_s >= end and injected >= seen.faults:
            break
        time.sleep(step.pause_s)
        if job.states().get(PS_SERVICE, {}).get("status") == "exited":
            seen.ended_early = (time.monotonic() - began) / 60
            print("    the PS has exited (the job ended): no more faults", file=out, flush=True)
            break
        try:
            result = FAULTS[step.kind](job, step, seen.ctx)
        except Exception as error:  # noqa: BLE001 - the engine refused (a PS not running to scale): not recovered
            result = FaultResult(
                step.kind, "-", time.time(), notes=f"not injected in full: {type(error).__name__}: {error}"
            )
        seen.results.append(result)
        seen.audits.append(job.audit())
        print(f"    [{(time.monotonic() - began) / 60:4.1f} min] {describe(result)}", file=out, flush=True)
    seen.faults_minutes = (time.monotonic() - began) / 60


def describe(r: FaultResult) -> str:
    if r.skipped:
        return f"{r.kind}: skipped ({r.skipped})"
    took = "NOT recovered" if r.recovered_s is None else f"recovered in {r.recovered_s:.1f} s"
    return f"{r.kind} {r.target}: {took}; {r.notes}"


def wait_end(job: SoakJob, timeout: float) -> tuple[dict[str, dict[str, Any]], Optional[Shm]]:
    """Until every container has exited: their states, and the job's /dev/shm as it was once the
    PS had exited (None: the namespace had ended already)."""
    seen: dict[str, Optional[Shm]] = {}

    def ended() -> Optional[dict[str, dict[str, Any]]]:
        states = job.states()
        if "shm" not in seen and states.get(PS_SERVICE, {}).get("status") == "exited":
            seen["shm"] = job.shm()
        return states if all(v["status"] == "exited" for v in states.values()) else None

    states = wait_for(ended, timeout)
    return states or job.states(), seen.get("shm")


def soak(job: SoakJob, seen: Observed, out: TextIO) -> None:
    """Start the job, inject the faults, let it finish, read what it left."""
    started = time.monotonic()
    job.up()
    job.keep_volume()
    warm_up(job)
    at_least = f" (and at least {seen.faults} faults)" if seen.faults else ""
    print(f"==> the job trains and has checkpointed; faults for {seen.minutes:g} min{at_least}", file=out, flush=True)
    seen.ctx = Context(job.t.workers.count, job.t.max_workers, job.t.ps.rpc_timeout, RECOVERY_S)
    seen.audits.append(job.audit())
    inject(job, seen, out)
    print("==> faults over; waiting for the job to finish", file=out, flush=True)
    seen.states, seen.shm_end = wait_end(job, END_WAIT_FACTOR * seen.minutes * 60 + 300)
    seen.job_minutes = (time.monotonic() - started) / 60


def collect(job: SoakJob, seen: Observed, run_dir: Path) -> None:
    """What the job left, read before it is removed: the logs, the PS's records, the last audit."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "containers.log").write_text(job.logs(), encoding="utf-8")
    if job.keeper is None:
        return
    seen.audits.append(job.audit())
    seen.ps = job.records()
    (run_dir / "metrics").mkdir(exist_ok=True)
    for name, lines in job.metrics_files().items():
        (run_dir / "metrics" / name).write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")
    if not seen.states:
        seen.states = job.states()


def judge(seen: Observed) -> list[Row]:
    final = seen.audits[-1] if seen.audits else Audit(0.0, {})
    corrupted = seen.ctx.corrupted if seen.ctx else set()
    ran = f"faults for {seen.faults_minutes or seen.minutes:.1f} min, the job ran {seen.job_minutes:.1f} min in all"
    if seen.ended_early is not None:
        ran = f"the job ended {seen.ended_early:.1f} min into the {seen.minutes:g} min of faults (a faster host?)"
    rows = [Row("the soak ran to its end", not seen.error and seen.ended_early is None, seen.error or ran)]
    rows += [
        checks.run_finished(seen.ps, final, seen.states.get(PS_SERVICE, {}).get("exit_code")),
        checks.resumes_continue(seen.ps, corrupted),
        checks.checkpoints_kept(seen.ps, seen.audits, corrupted),
        checks.accuracy(seen.ps, THRESHOLD),
        checks.containers_exited(seen.states, seen.ctx.scaled if seen.ctx else set()),
        checks.faults_recovered(seen.results),
        checks.full_volume_restarts_none(seen.results),
        *checks.segment_rows(seen.results),
        checks.shm_at_end(seen.shm_end),
        *checks.nothing_left(seen.leftovers, final),
    ]
    return rows


def run(
    minutes: float,
    seed: Optional[int],
    run_dir: Path,
    epochs: Optional[int] = None,
    out: TextIO = sys.stdout,
    name: Optional[str] = None,
    faults: int = 0,
) -> int:
    """The soak; its tables on `out`, its logs and findings in `run_dir`; 0 when every invariant
    holds. `faults`: at least that many, even past the minutes (a slow host's recoveries)."""
    return soak_one(minutes, seed, run_dir, epochs, out, name, faults).code


@dataclass
class SeedResult:
    """One soak of a `--seeds` series: its seed, the faults injected, the invariants."""

    seed: int
    faults: int
    rows: list[Row]

    @property
    def code(self) -> int:
        return 0 if all(r.passed for r in self.rows) else 1


def soak_one(
    minutes: float,
    seed: Optional[int],
    run_dir: Path,
    epochs: Optional[int] = None,
    out: TextIO = sys.stdout,
    name: Optional[str] = None,
    faults: int = 0,
) -> SeedResult:
    """One soak (see `run`): its seed, faults and invariant rows."""
    seen = Observed(seed if seed is not None else new_seed(), minutes, faults)
    t = soak_topology(minutes, epochs, name)
    client = images.client()
    if name is not None:
        refuse_taken(client, name)
    print(
        f"==> chaos soak: {minutes:g} min of faults, seed {seen.seed}, project {t.name} "
        f"(replay: python -m orchestrator chaos soak --minutes {minutes:g}"
        f"{f' --faults {faults}' if faults else ''} --seed {seen.seed})",
        file=out,
        flush=True,
    )
    base, pip_source = images.source(t, offline=True)
    images.build(t.image_tag, base, pip_source, out=io.StringIO())
    job = SoakJob(t, t.name, VOLUME_MB, WORKER_CPUS)
    try:
        soak(job, seen, out)
    except Exception as error:  # noqa: BLE001 - the engine, a wait that timed out, a bug: the table says so
        seen.error = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "error.txt").write_text(traceback.format_exc(), encoding="utf-8")
    finally:
        try:
            collect(job, seen, run_dir)
        finally:
            job.close()
    seen.leftovers = job.leftovers()
    rows = judge(seen)
    report(seen, rows, run_dir, out)
    return SeedResult(seen.seed, len([r for r in seen.results if not r.skipped]), rows)


def run_seeds(
    minutes: float,
    count: int,
    run_root: Path,
    out: TextIO = sys.stdout,
    name: Optional[str] = None,
    faults: int = 0,
) -> int:
    """`count` soaks one after another, each with a new seed (its logs in run_root/seed-<seed>/),
    then one table: seed, faults, invariants held and failed, result. 0 when every soak held."""
    done: list[SeedResult] = []
    for i in range(count):
        seed = new_seed()
        print(f"==> soak {i + 1} of {count}: seed {seed}", file=out, flush=True)
        done.append(soak_one(minutes, seed, run_root / f"seed-{seed}", out=out, name=name, faults=faults))
        print(file=out, flush=True)
    print(f"{count} soaks of {minutes:g} min:", file=out)
    for line in seeds_table(done):
        print(line, file=out)
    out.flush()
    return 0 if all(r.code == 0 for r in done) else 1


def seeds_table(done: list[SeedResult]) -> list[str]:
    """One row a soak: seed, faults injected, invariants held, failed, and the failed ones named."""
    body = []
    for r in done:
        failed = [row.invariant for row in r.rows if not row.passed]
        held = len(r.rows) - len(failed)
        result = "pass" if not failed else "FAIL: " + "; ".join(failed)
        body.append((str(r.seed), str(r.faults), str(held), str(len(failed)), result))
    return checks.columns([("SEED", "FAULTS", "HELD", "FAILED", "RESULT"), *body])


def report(seen: Observed, rows: list[Row], run_dir: Path, out: TextIO) -> None:
    injected = [r for r in seen.results if not r.skipped]
    print(file=out)
    print(
        f"seed {seen.seed}: {len(injected)} faults in {seen.minutes:g} min; the job ran {seen.job_minutes:.1f} min",
        file=out,
    )
    for line in checks.fault_table(seen.results):
        print(line, file=out)
    print(file=out)
    for line in checks.invariant_table(rows):
        print(line, file=out)
    (run_dir / "soak.json").write_text(
        json.dumps(
            {
                "seed": seen.seed,
                "minutes": seen.minutes,
                "faults": [asdict(r) for r in seen.results],
                "invariants": [asdict(r) for r in rows],
                "audits": len(seen.audits),
            },
            indent=1,
        ),
        encoding="utf-8",
    )
    print(f"(logs and findings in {run_dir})", file=out, flush=True)
