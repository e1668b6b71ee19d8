"""The local target: the job's services as processes of this host, under one launcher
(`python -m orchestrator local`, orchestrator/verbs/local.py), no Docker.

Its document is the topology itself, every override applied (runs/<name>/local.yaml). `deploy`
starts a launcher on it in a session of its own, its output in runs/<name>/local.log; the other
blocks read what the launcher leaves in the run's directory: its processes' states
(local-state.json, backends/local/states.py), its lock (held while the run lives,
orchestrator/run_lock.py), its metrics files, its log. So the blocks work from any process of
the account, as compose's read the engine.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import Optional, TextIO

import yaml

from orchestrator import run_lock, runs
from orchestrator.backends.base import ENDED, EVERY_LINE, Backend, Cluster, LogLines, LogOptions, ServiceState
from orchestrator.backends.lines import ProcessLines
from orchestrator.backends.local import states
from orchestrator.errors import UsageError, last_line
from orchestrator.pids import alive
from orchestrator.topology.model import Topology, load
from orchestrator.topology.services import service_names

START_SECONDS = 60.0  # deploy: until the launcher has started every process
STOP_SECONDS = 30.0  # remove: until the launcher has stopped them (it gives each 15 s, then SIGKILL)
POLL = 0.1
STATE_DIRS = ("checkpoints", "metrics")  # what `remove` with volumes takes: the run's state


class LocalBackend(Backend):
    name = "local"
    output = "local.yaml"
    noun = "run"
    summary = "local processes (no Docker, one host)"
    engine = False
    unit = "process"
    missing = "no process"
    removed = "stopped"

    def render(self, t: Topology, data_root: str) -> str:
        """The topology as YAML, every override applied: what the launcher reads (relative paths
        stay relative to where it starts)."""
        return yaml.safe_dump(t.model_dump(mode="json", exclude_none=True), sort_keys=False)

    def name_of(self, t: Topology) -> str:
        return t.name

    # --- the blocks ------------------------------------------------------------------
    def deploy(self, c: Cluster, env: dict[str, str], out: TextIO) -> list[str]:
        """Start a launcher on `c.file` (runs/<name>/local.yaml: the run's directory is its
        folder) in a session of its own, and return once it has started every process. `env`:
        the run's variables (orchestrator.runs), as the app of a compose project gets them: the
        run's id, and with PSC_RESUME true, it continues its newest unfinished checkpoint."""
        run_dir = c.file.parent
        argv = [sys.executable, "-m", "orchestrator", "local", "-c", str(c.file), "--name", c.name]
        argv += ["--runs-dir", str(run_dir.parent)]
        argv += ["--run-id", env[runs.RUN_ID]] if env.get(runs.RUN_ID) else []
        argv += ["--resume"] if env.get(runs.RESUME) == "true" else []
        print(f"==> starting {c.name} as local processes, output in {run_dir / states.LOG_FILE}", file=out, flush=True)
        # The app's output is its account's alone, as the run's state file and secret are.
        fd = os.open(run_dir / states.LOG_FILE, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        with os.fdopen(fd, "ab") as log:
            launcher = subprocess.Popen(
                argv,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # outlives this process, as a compose project does
            )
        # Reaped as it ends: a launcher of this process must not linger as a zombie, which
        # would still look alive (to `tail --pid` and to `alive`).
        threading.Thread(target=launcher.wait, name=f"reap-{launcher.pid}", daemon=True).start()
        wanted = set(self._service_names(c))
        deadline = time.monotonic() + START_SECONDS
        while time.monotonic() < deadline:
            data = states.read(run_dir)
            if data and data.get("launcher") == launcher.pid and wanted <= set(data["services"]):
                return []
            if launcher.poll() is not None:
                said = last_line((run_dir / states.LOG_FILE).read_text(encoding="utf-8", errors="replace"))
                raise UsageError(f"local: {c.name} did not start (exit status {launcher.returncode}): {said}")
            time.sleep(POLL)
        launcher.terminate()
        raise UsageError(f"local: {c.name}: its processes not all started within {START_SECONDS:.0f} s")

    def describe(self, c: Cluster) -> list[ServiceState]:
        """Each process the launcher started, as it last said; `dead` for one it said runs when
        no process of the run lives any more (a launcher killed with SIGKILL)."""
        run_dir = c.file.parent
        data = states.read(run_dir)
        if data is None:
            return []
        live = run_lock.live_run(run_dir) is not None
        found = []
        for service, s in data["services"].items():
            status = str(s.get("status", "missing"))
            if status not in ENDED and not live:
                status = "dead"
            code = s.get("exit_code")
            found.append(
                ServiceState(service, status, exit_code=code if isinstance(code, int) else None, restarts=s["restarts"])
            )
        return found

    def log_iter(self, c: Cluster, follow: bool, options: LogOptions = EVERY_LINE) -> LogLines:
        """The launcher's output (each line prefixed by its service), following it while the run lives."""
        if options.timestamps or options.since is not None:
            raise UsageError("logs: a local run's log has no times: drop --timestamps and --since")
        path = c.file.parent / states.LOG_FILE
        if not path.exists():
            raise UsageError(f"local: {c.name}: no log at {path} (a run its deploy started writes one)")
        tail = "+1" if options.tail in (None, "all") else str(options.tail)
        argv = ["tail", "-n", tail, str(path)]
        launcher = self._launcher(c)
        if follow and launcher is not None:
            argv[1:1] = ["-f", f"--pid={launcher}"]  # GNU tail ends once the launcher has
        return ProcessLines([argv])

    def remove(self, c: Cluster, volumes: bool) -> None:
        """SIGTERM the launcher (it stops its processes: SIGTERM, then SIGKILL after 15 s) and
        wait until the run's lock is free; with `volumes`, its checkpoints and metrics go too."""
        run_dir = c.file.parent
        launcher = self._launcher(c)
        if launcher is not None:
            os.kill(launcher, signal.SIGTERM)
        deadline = time.monotonic() + STOP_SECONDS
        while run_lock.live_run(run_dir) is not None:
            if time.monotonic() > deadline:
                raise UsageError(f"local: {c.name}: still running {STOP_SECONDS:.0f} s after SIGTERM")
            time.sleep(POLL)
        if volumes:
            for sub in STATE_DIRS:
                shutil.rmtree(run_dir / sub, ignore_errors=True)

    def read_records(self, c: Cluster, service: str) -> dict[str, list[str]]:
        found = {}
        for path in sorted((c.file.parent / "metrics").glob("*.jsonl")):
            try:
                found[path.name] = path.read_text(encoding="utf-8", errors="replace").splitlines()
            except OSError:
                continue
        return found

    def running_env(self, c: Cluster, names: Sequence[str]) -> dict[str, str]:
        run_id = run_lock.live_run(c.file.parent)
        return {} if run_id is None or runs.RUN_ID not in names else {runs.RUN_ID: run_id}

    def signal_app(self, c: Cluster, service: str, signal_name: str) -> float:
        data = states.read(c.file.parent) or {"services": {}}
        pid = (data["services"].get(service) or {}).get("pid")
        if not isinstance(pid, int) or self._launcher(c) is None:
            raise UsageError(f"local: {c.name}: no live process of service {service!r}")
        sent = time.time()
        try:
            os.kill(pid, getattr(signal, signal_name))
        except ProcessLookupError:  # it ended meanwhile: the launcher sees to it
            pass
        return sent

    # --- helpers -----------------------------------------------------------------------
    def _launcher(self, c: Cluster) -> Optional[int]:
        """The pid of the run's launcher while the run lives; None when none does."""
        data = states.read(c.file.parent)
        pid = data.get("launcher") if data else None
        live = run_lock.live_run(c.file.parent) is not None
        return pid if isinstance(pid, int) and live and alive(pid) else None

    def _service_names(self, c: Cluster) -> list[str]:
        return service_names(c.topology if c.topology is not None else load(c.file))


BACKEND = LocalBackend()
