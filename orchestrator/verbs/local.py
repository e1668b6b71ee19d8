"""`python -m orchestrator local`: the PS and the workers as local processes.

The same cluster as the compose file, without Docker: each service becomes a
`python -m app ps|worker` process with the environment the render gives its
container (`orchestrator.render.compose.app_environment`), except the address (127.0.0.1, a free
port), the paths (data_dir as on the host, runs/<name>/ for checkpoints and
metrics), the interface (loopback) and the exchange: a PS job's processes talk over UNIX
sockets in a 0700 directory of the run's, proving the run's secret (runs/<name>/secret, 0600),
both made as the run starts and removed as it ends (orchestrator.job_secret); an allreduce
job's ranks rendezvous through files in that directory (a c10d FileStore, no TCPStore) and
then talk Gloo on 127.0.0.1, which has no authentication. Output is prefixed by service name, as
compose prints it. Ctrl-C, SIGTERM or SIGHUP (the terminal closed) stops every process;
output that can no longer be written (a closed terminal) is dropped, the stop goes on.

One live run per name (the topology's, or `--name`): the run holds runs/<name>/local.lock
(orchestrator.run_lock) from before its first process starts until its last one ends; a
second `local` of the name is refused with one line naming the live run.

A process that fails (exits non-zero, or is killed) is started again with the same
environment, as compose's `restart: on-failure` does, at most RESTARTS times (each one
logged): a worker rejoins the running job, a PS or PS shard resumes from its newest
checkpoint, as restarted containers do. Exit status 2 (bad input, or its rank taken by a
process that still answers) is not retried, nor is a worker once the PS has ended for good.
A process out of restarts, and under `allreduce` (no PS: a lost peer fails every rank) any
failure, stop every process.

The launcher keeps what it knows of each process in runs/<name>/local-state.json, which the
local target's blocks read (orchestrator/backends/local/backend.py).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import stat
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

from orchestrator import job_secret, run_lock, runs, user_packages
from orchestrator.errors import UsageError
from orchestrator.host_paths import check_paths
from orchestrator.paths import DEFAULT_CONFIG
from orchestrator.pids import alive
from orchestrator.render.compose import app_environment
from orchestrator.render.yamlio import write_atomic
from orchestrator.topology.model import Topology, TopologyError, load_with
from orchestrator.topology.services import Service, describe, has_ps, services
from orchestrator.verbs import live_names
from orchestrator.verbs.supervisor import RESTARTS, ProcessSpec, Supervisor, spawn

__all__ = ["RESTARTS", "ProcessSpec", "Supervisor", "spawn"]  # where the other verbs and tests take them

LOCALHOST = "127.0.0.1"
RUNS_DIR = "runs"
LOCAL_RECORD = "local.json"  # what the last local run of a name was started from
SHM_ROOT = Path("/dev/shm")


def local_environment(
    t: Topology,
    rank: int,
    *,
    port: int,
    run_dir: Path,
    ifname: str,
    run_id: str = "",
    resume: runs.Resume = False,
    exchange: Optional[Mapping[str, str]] = None,
) -> dict[str, str]:
    """The app's environment for `rank` on this host (see `app_environment`), in run `run_id`
    (orchestrator.runs; empty: the app resumes any checkpoint), with the run's private
    `exchange` (orchestrator.job_secret) where the job has a PS."""
    source, eval_source = t.data_source(), t.eval_source()
    data_dir = str(Path(source).expanduser().resolve()) if source else ("" if t.reads_files else None)
    weights = t.train.init_weights
    env = app_environment(
        t,
        rank,
        master_addr=LOCALHOST,
        master_port=port,
        data_dir=data_dir,
        checkpoint_dir=str(run_dir.resolve() / "checkpoints"),
        metrics_dir=str(run_dir.resolve() / "metrics"),
        cache_dir=str(run_dir.resolve() / "cache"),
        ifname=ifname,
        init_weights=str(Path(weights).expanduser().resolve()) if weights is not None else None,
        eval_dir=str(Path(eval_source).expanduser().resolve()) if eval_source else None,
    )
    env.update(runs.environment(run_id, resume))
    if exchange and has_ps(t):
        env.update(exchange)
    elif exchange:  # allreduce: its rendezvous files in the directory (app.allreduce.filestore), no TCPStore
        env[job_secret.SOCKET_DIR_ENV] = exchange[job_secret.SOCKET_DIR_ENV]
    if run_id and has_ps(t):
        env["PSC_SHM_DIR"] = str(shm_dir(t, run_id))
    if rank == 0 and has_ps(t):  # the PS logs the run to MLflow where the caller set a tracking URI
        env["MLFLOW_TRACKING_URI"] = os.environ.get("MLFLOW_TRACKING_URI", "")
        env["MLFLOW_EXPERIMENT_NAME"] = os.environ.get("MLFLOW_EXPERIMENT_NAME") or t.name
    if t.code is not None:  # the user's code first on sys.path, then what the caller had
        inherited = os.environ.get("PYTHONPATH", "")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(t.code).expanduser().resolve()), inherited]))
    if t.cuda:
        # What the container's device reservation does: the process sees one GPU, as cuda:0.
        gpu = t.ps_gpu() if rank == 0 else t.worker_gpus()[rank - 1]
        env["CUDA_VISIBLE_DEVICES"] = "" if gpu is None else str(gpu)
    return env


def shm_dir(t: Topology, run_id: str, launcher: Optional[int] = None) -> Path:
    """Where a local run's PS processes make their shared-memory segments (the app makes the
    directory): one directory a run, named after its launcher's pid (this process), removed
    when the run ends, whatever became of its processes, so a killed PS leaves nothing in
    /dev/shm; a killed launcher's is removed by the next run (`remove_stale_shm`)."""
    return SHM_ROOT / f"psc-{launcher or os.getpid()}-{t.name}-{run_id}"


_RUN_ID = r"\d{8}-\d{6}-[0-9a-f]{6}"


def remove_stale_shm(t: Topology) -> list[Path]:
    """The run directories /dev/shm still holds whose launcher was killed before it could
    remove them, removed: of any name, this account's, once their launcher is gone and no
    process maps a file of them; and, in the older naming (`psc-<name>-<run id>`, no pid),
    those of `t`'s name (called with the run's lock held: no other run of the name is live)."""
    mapped = _mapped_shm()
    stale = []
    for d in SHM_ROOT.glob("psc-*") if SHM_ROOT.is_dir() else []:
        named = re.fullmatch(rf"psc-(\d+)-.+-{_RUN_ID}", d.name)
        older = re.fullmatch(rf"psc-{re.escape(t.name)}-{_RUN_ID}", d.name)
        if d.name in mapped or not _mine(d):
            continue
        if (named and not alive(int(named[1]))) or (older and not named):
            shutil.rmtree(d, ignore_errors=True)
            stale.append(d)
    return stale


def _mine(path: Path) -> bool:
    """Whether `path` is a directory of this account's (not a link, not another user's)."""
    try:
        info = path.lstat()
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid()


def _mapped_shm() -> set[str]:
    """The /dev/shm directories some process maps a file of (a run of another runs/ directory
    may be live under the same name): their names."""
    names = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:  # gone, or another user's
            continue
        names.update(re.findall(r"/dev/shm/(psc-[^/\s]+)/", text))
    return names


def service_environment(
    t: Topology,
    service: Service,
    *,
    port: int,
    run_dir: Path,
    ifname: str,
    run_id: str = "",
    resume: runs.Resume = False,
    exchange: Optional[Mapping[str, str]] = None,
) -> dict[str, str]:
    """`local_environment` of one service: its rank's, plus PSC_SHARD for a PS shard."""
    env = local_environment(
        t, service.rank, port=port, run_dir=run_dir, ifname=ifname, run_id=run_id, resume=resume, exchange=exchange
    )
    if service.shard:
        env["PSC_SHARD"] = str(service.shard)
    return env


def plan(
    t: Topology,
    *,
    port: int,
    run_dir: Path,
    ifname: str,
    python: str = sys.executable,
    run_id: str = "",
    resume: runs.Resume = False,
    exchange: Optional[Mapping[str, str]] = None,
) -> list[ProcessSpec]:
    """One process per service, in rank order (the PS first; for allreduce, no PS and
    worker1, DDP rank 0, first), every one in run `run_id`."""
    specs = []
    restarts = RESTARTS if has_ps(t) else 0
    for s in services(t):
        env = service_environment(
            t, s, port=port, run_dir=run_dir, ifname=ifname, run_id=run_id, resume=resume, exchange=exchange
        )
        specs.append(ProcessSpec(s.name, app_argv(s.role, python=python), env, restarts, anchor=s.role != "worker"))
    return specs


def export_environment(t: Topology, state: Path, run_id: str, into: Path) -> dict[str, str]:
    """The whole environment of `python -m app export` on make local's run `run_id` of `t`:
    that of its PS (allreduce: worker1), writing to `into`."""
    # port: none is opened (the export joins no job), but the app checks it is one
    env = local_environment(t, 0 if has_ps(t) else 1, port=1, run_dir=state, ifname=loopback_ifname(), run_id=run_id)
    env.pop("PSC_SHM_DIR", None)
    return {**os.environ, **env, "PSC_EXPORT_DIR": str(into.resolve())}


def app_argv(*args: str, python: str = sys.executable) -> list[str]:
    """`python -m app ARGS` with this interpreter (the app's venv when run from it)."""
    return [python, "-m", "app", *args]


def check_host(t: Topology, source: str) -> None:
    """Bad input that only the host can reveal (the render does not look)."""
    check_paths(t, source, Path.cwd())
    for key, folder in (("data_dir", t.data_source()), ("eval_data", t.eval_source())):
        if folder is not None and not Path(folder).expanduser().is_dir():
            raise TopologyError(
                source,
                f"train.{key}",
                f"got {getattr(t.train, key)!r}; no such directory on this host (from {os.getcwd()})",
            )


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOCALHOST, 0))
        return s.getsockname()[1]


def loopback_ifname() -> str:
    names = [name for _, name in socket.if_nameindex()] if hasattr(socket, "if_nameindex") else []
    return next((n for n in ("lo", "lo0") if n in names), "lo")


def run(
    t: Topology,
    *,
    source: str,
    keep_going: bool = False,
    runs_dir: str = RUNS_DIR,
    resume: runs.Resume = False,
    run_id: str = "",
) -> int:
    """Run the cluster of `t` as processes, as a new run (orchestrator.runs; `resume`: it
    continues the newest unfinished checkpoint, or the run of that id), of id `run_id` (default:
    a new one); the exit status of the whole run."""
    check_host(t, source)
    versions = user_packages.check_local(t)
    run_dir = Path(runs_dir) / t.name
    try:
        for sub in ("checkpoints", "metrics"):
            (run_dir / sub).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"{run_dir}: cannot create: {e.strerror or e}") from None
    run_id = runs.chosen(resume) or run_id or runs.new_id()
    lock = run_lock.hold(run_dir, run_id, t.name)
    try:
        live_names.refuse_elsewhere(
            t.name, live_names.LOCAL, "local", f"--name {t.name[:48]}-2", _targets(), Path(runs_dir)
        )
        remember(run_dir, t, source)
    except BaseException:
        os.close(lock)
        raise
    try:
        remove_stale_shm(t)
        with job_secret.private_exchange(run_dir) as exchange:
            specs = plan(
                t,
                port=free_port(),
                run_dir=run_dir,
                ifname=loopback_ifname(),
                run_id=run_id,
                resume=resume,
                exchange=exchange,
            )
            where = (
                f"on UNIX sockets in {exchange[job_secret.SOCKET_DIR_ENV]}"
                if has_ps(t)
                else f"rendezvous in {exchange[job_secret.SOCKET_DIR_ENV]}, Gloo on {LOCALHOST}"
            )
            print(f"local: {t.name}: {describe(t)} {where}, state in {run_dir}/", flush=True)
            print(f"local: {runs.describe(run_id, resume)}", flush=True)
            if user_packages.record(run_dir, versions):
                print(f"local: image.packages: {user_packages.described(versions)}", flush=True)
            for said in (tracking_note(t, os.environ), t.env_unset(os.environ)):
                if said:
                    print(f"local: {said}", flush=True)
            return Supervisor(specs, keep_going=keep_going, pass_fds=(lock,), state_dir=run_dir).run()
    finally:
        shutil.rmtree(shm_dir(t, run_id), ignore_errors=True)
        os.close(lock)


def remember(run_dir: Path, t: Topology, source: str) -> None:
    """Keep what the run was started from (runs/<name>/local.json: the topology file and its
    overrides), so `export --local --name NAME` and `tensorboard --local --name NAME` find it."""
    record = {"name": t.name, "config": str(Path(source).absolute()), "overrides": list(t.overrides)}
    write_atomic(run_dir / LOCAL_RECORD, json.dumps(record, indent=2) + "\n")


def topology_of(
    config: Optional[str], workers: Optional[int] = None, strategy: Optional[str] = None, name: Optional[str] = None
) -> Topology:
    """The topology a verb on `local`'s runs acts on: `config` when given, else the one the last
    local run of `name` was started from (its overrides too), else the default topology."""
    if config is None and name is not None:
        try:
            record = json.loads((Path(RUNS_DIR) / name / LOCAL_RECORD).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            record = None
        if isinstance(record, dict) and isinstance(record.get("config"), str):
            overrides = tuple(str(o) for o in record.get("overrides") or ())
            return load_with(record["config"], workers=workers, strategy=strategy, name=name, overrides=overrides)
    return load_with(config or DEFAULT_CONFIG, workers=workers, strategy=strategy, name=name)


def _targets() -> list[Any]:
    """The targets a name may be live on besides `local` (orchestrator/verbs/live_names.py)."""
    from orchestrator.backends.registry import BACKENDS

    return list(BACKENDS.values())


def tracking_note(t: Topology, environ: Mapping[str, str]) -> Optional[str]:
    """What a local run says of `tracking.mlflow: true`: its server is a compose service, and the
    processes log where MLFLOW_TRACKING_URI says (as without it); None without it."""
    if not t.tracking.mlflow:
        return None
    where = environ.get("MLFLOW_TRACKING_URI") or "nowhere (MLFLOW_TRACKING_URI is not set)"
    return f"tracking.mlflow: the project's own MLflow server is a compose service; the PS logs to {where}"
