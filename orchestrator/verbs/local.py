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

A worker that fails (exits non-zero, or is killed) is started again with the same
environment, as compose's `restart: on-failure` does, at most WORKER_RESTARTS times
(each one logged); it rejoins the running job as a restarted container does. Exit
status 2 (bad input, or its rank taken by a process that still answers) is not
retried, nor is a worker once the PS has ended. A PS or PS shard that fails, a worker out of restarts, and under
`allreduce` (no PS: a lost peer fails every rank) any failure stop every process.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import io
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Optional

from orchestrator import job_secret, run_lock, runs
from orchestrator.errors import UsageError
from orchestrator.host_paths import check_paths
from orchestrator.render.compose import app_environment
from orchestrator.topology.model import Topology, TopologyError
from orchestrator.topology.services import Service, describe, has_ps, services

LOCALHOST = "127.0.0.1"
RUNS_DIR = "runs"
STOP_GRACE_SECONDS = 15.0
WORKER_RESTARTS = 3  # as the swarm render's max_attempts
RESTART_DELAY_SECONDS = 1.0
SHM_ROOT = Path("/dev/shm")


@dataclass(frozen=True)
class ProcessSpec:
    name: str
    argv: list[str]
    env: dict[str, str]  # added to this process's environment
    restarts: int = 0  # times it is started again after failing (exit status other than 0 and 2)


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


def shm_dir(t: Topology, run_id: str) -> Path:
    """Where a local run's PS processes make their shared-memory segments (the app makes the
    directory): one directory a run, removed when the run ends, whatever became of its
    processes, so a killed PS leaves nothing in /dev/shm."""
    return SHM_ROOT / f"psc-{t.name}-{run_id}"


def remove_stale_shm(t: Topology) -> list[Path]:
    """The directories of earlier runs of `t`'s name that /dev/shm still holds (their launcher
    was killed before it could remove them), removed: called with the run's lock held, so
    no other run of the name is live."""
    mapped = _mapped_shm()
    stale = [
        d
        for d in (SHM_ROOT.glob(f"psc-{glob.escape(t.name)}-*") if SHM_ROOT.is_dir() else [])
        if re.fullmatch(rf"psc-{re.escape(t.name)}-\d{{8}}-\d{{6}}-[0-9a-f]{{6}}", d.name) and d.name not in mapped
    ]
    for d in stale:
        shutil.rmtree(d, ignore_errors=True)
    return stale


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
    restarts = WORKER_RESTARTS if has_ps(t) else 0
    for s in services(t):
        env = service_environment(
            t, s, port=port, run_dir=run_dir, ifname=ifname, run_id=run_id, resume=resume, exchange=exchange
        )
        specs.append(
            ProcessSpec(s.name, app_argv(s.role, python=python), env, restarts=restarts if s.role == "worker" else 0)
        )
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


def spawn(
    argv: list[str],
    env: dict[str, str],
    *,
    stdout: Any,
    stderr: Any = subprocess.STDOUT,
    new_session: bool = False,
    pass_fds: tuple[int, ...] = (),
) -> subprocess.Popen:
    """The one way a local process of the job starts: `env` over this process's environment,
    unbuffered output, no stdin; `new_session` puts it (and its children) in its own group;
    `pass_fds` stay open in it (the run's lock). It gets SIGTERM when the thread that started
    it ends, so a launcher killed with SIGKILL leaves no process of its job training on."""
    return subprocess.Popen(
        argv,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
        stdin=subprocess.DEVNULL,
        stdout=stdout,
        stderr=stderr,
        start_new_session=new_session,
        pass_fds=pass_fds,
        preexec_fn=functools.partial(_end_with, os.getpid()),
    )


def _end_with(launcher: int) -> None:
    """In the child before exec: SIGTERM when the launcher's thread ends (Linux's
    PR_SET_PDEATHSIG; elsewhere nothing), and at once if the launcher is already gone."""
    if _LIBC is not None:
        _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != launcher:
            os.kill(os.getpid(), signal.SIGTERM)


PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


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
    t: Topology, *, source: str, keep_going: bool = False, runs_dir: str = RUNS_DIR, resume: runs.Resume = False
) -> int:
    """Run the cluster of `t` as processes, as a new run (orchestrator.runs; `resume`: it
    continues the newest unfinished checkpoint, or the run of that id); the exit status of the whole run."""
    check_host(t, source)
    run_dir = Path(runs_dir) / t.name
    try:
        for sub in ("checkpoints", "metrics"):
            (run_dir / sub).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"{run_dir}: cannot create: {e.strerror or e}") from None
    run_id = runs.chosen(resume) or runs.new_id()
    lock = run_lock.hold(run_dir, run_id, t.name)
    try:
        refuse_live_compose(t)
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
            for said in (tracking_note(t, os.environ), t.env_unset(os.environ)):
                if said:
                    print(f"local: {said}", flush=True)
            return Supervisor(specs, keep_going=keep_going, pass_fds=(lock,)).run()
    finally:
        shutil.rmtree(shm_dir(t, run_id), ignore_errors=True)
        os.close(lock)


def refuse_live_compose(t: Topology) -> None:
    """UsageError (one line) when a compose run of `t`'s name is live on this host's engine: both
    would write runs/<name>/. No engine, nothing to refuse."""
    from orchestrator import images
    from orchestrator.backends.compose import adapter
    from orchestrator.errors import EngineError
    from orchestrator.render.compose import project_name

    try:
        live = adapter.running_env(images.client(timeout=10), project_name(t), runs.VARIABLES)
    except (EngineError, OSError):
        return
    if live:
        raise UsageError(
            f"local: compose project {project_name(t)} has a live run {live.get(runs.RUN_ID) or '(no id)'} of this "
            f"name; give this one another name (--name {t.name[:48]}-2), "
            f"or end that one first (make down NAME={t.name})"
        )


def tracking_note(t: Topology, environ: Mapping[str, str]) -> Optional[str]:
    """What a local run says of `tracking.mlflow: true`: its server is a compose service, and the
    processes log where MLFLOW_TRACKING_URI says (as without it); None without it."""
    if not t.tracking.mlflow:
        return None
    where = environ.get("MLFLOW_TRACKING_URI") or "nowhere (MLFLOW_TRACKING_URI is not set)"
    return f"tracking.mlflow: the project's own MLflow server is a compose service; the PS logs to {where}"


class Supervisor:
    """Starts processes, prefixes their output, starts a failed one again while its spec's
    `restarts` last, stops them all on any other failure or on a signal."""

    def __init__(
        self,
        specs: list[ProcessSpec],
        *,
        keep_going: bool = False,
        out: Optional[IO[str]] = None,
        grace: float = STOP_GRACE_SECONDS,
        restart_delay: float = RESTART_DELAY_SECONDS,
        pass_fds: tuple[int, ...] = (),
    ) -> None:
        self.specs = specs
        self.pass_fds = pass_fds
        self.keep_going = keep_going
        self.out = out or sys.stdout
        self.grace = grace
        self.restart_delay = restart_delay
        self.width = max(len(s.name) for s in specs)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._signal: Optional[int] = None
        self._mute = False

    def run(self) -> int:
        restore = self._install_signal_handlers()
        procs: dict[str, subprocess.Popen] = {}
        readers: list[threading.Thread] = []
        codes: dict[str, int] = {}
        by_name = {spec.name: spec for spec in self.specs}
        restarted: dict[str, int] = {}

        def start(spec: ProcessSpec) -> None:
            # Its own session: our signals, not the terminal's, stop it.
            p = spawn(spec.argv, spec.env, stdout=subprocess.PIPE, new_session=True, pass_fds=self.pass_fds)
            procs[spec.name] = p
            readers.append(threading.Thread(target=self._pump, args=(spec.name, p.stdout), daemon=True))
            readers[-1].start()

        try:
            for spec in self.specs:
                if self._stop.is_set():
                    break
                start(spec)
            failed = False
            while len(codes) < len(procs):
                for name, p in list(procs.items()):
                    if name in codes or p.poll() is None:
                        continue
                    code, spec = p.returncode, by_name[name]
                    n = restarted.get(name, 0)
                    # Not once a process that is never restarted (the PS) has ended: nothing to rejoin.
                    anchors = [q for m, q in procs.items() if by_name[m].restarts == 0]
                    if (
                        code not in (0, 2)
                        and n < spec.restarts
                        and not self._stop.is_set()
                        and all(q.poll() is None for q in anchors)
                    ):
                        restarted[name] = n + 1
                        self._say(name, f"exited with code {code}; restarting ({n + 1} of {spec.restarts})")
                        if self._stop.wait(self.restart_delay):
                            codes[name] = code
                            break
                        start(spec)
                        continue
                    codes[name] = code
                    self._say(name, f"exited with code {code}")
                    failed = failed or code != 0
                if self._stop.is_set() or (failed and not self.keep_going):
                    break
                self._stop.wait(0.1)
        finally:
            self._stop_all(procs, codes)
            for r in readers:
                r.join(timeout=5)
            restore()
        if self._signal is not None:
            return 128 + self._signal
        bad = [c for c in codes.values() if c != 0]
        if not bad and len(codes) == len(self.specs):
            return 0
        return 2 if 2 in bad else 1

    def _stop_all(self, procs: dict[str, subprocess.Popen], codes: dict[str, int]) -> None:
        running = {n: p for n, p in procs.items() if p.poll() is None}
        for p in running.values():
            _signal_group(p, signal.SIGTERM)
        for name, p in running.items():
            try:
                p.wait(timeout=self.grace)
            except subprocess.TimeoutExpired:
                _signal_group(p, signal.SIGKILL)
                p.wait()
            codes[name] = p.returncode
            self._say(name, f"stopped (code {p.returncode})")

    def _pump(self, name: str, stream: IO[bytes]) -> None:
        for raw in iter(stream.readline, b""):
            self._say(name, raw.decode("utf-8", errors="replace").rstrip("\r\n"))
        stream.close()

    def _say(self, name: str, line: str) -> None:
        with self._lock:
            if self._mute:
                return
            try:
                self.out.write(f"{name:<{self.width}} | {line}\n")
                self.out.flush()
            except (OSError, ValueError):  # the terminal closed (EIO), the pipe's reader left: drop it
                self._mute = True
                _silence(self.out)

    def _install_signal_handlers(self):
        if threading.current_thread() is not threading.main_thread():
            return lambda: None

        def handler(signum, _frame):
            self._signal = signum
            self._stop.set()

        # SIGHUP: the terminal closed (or an ssh session ended); the run ends as on Ctrl-C.
        old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        return lambda: [signal.signal(s, h) for s, h in old.items()]


def _silence(out: IO[str]) -> None:
    """Point `out`'s file descriptor at /dev/null when it is a real one whose other end is gone,
    so that nothing written to it later fails (the interpreter's last flush included)."""
    try:
        fd = out.fileno()
        null = os.open(os.devnull, os.O_WRONLY)
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
        return
    try:
        os.dup2(null, fd)
    except OSError:
        pass
    finally:
        os.close(null)


def _signal_group(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)  # the app and its DataLoader workers
    except (ProcessLookupError, PermissionError):
        pass
