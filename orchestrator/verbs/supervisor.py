"""The local run's processes: how one starts (`spawn`), and the `Supervisor` that starts the
job's, prefixes their output with the service's name as compose prints it, starts a failed
process again as compose's `restart: on-failure` does (at most its spec's `restarts`, each
logged; exit status 2, bad input, is not retried, nor is a worker once the PS has ended for
good), and
stops them all on any other failure or on a signal (Ctrl-C, SIGTERM, SIGHUP: the terminal
closed); output that can no longer be written is dropped, the stop goes on."""

from __future__ import annotations

import ctypes
import functools
import io
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Optional

from orchestrator.backends.local import states

STOP_GRACE_SECONDS = 15.0
RESTARTS = 3  # as the swarm render's max_attempts
RESTART_DELAY_SECONDS = 1.0


@dataclass(frozen=True)
class ProcessSpec:
    name: str
    argv: list[str]
    env: dict[str, str]  # added to this process's environment
    restarts: int = 0  # times it is started again after failing (exit status other than 0 and 2)
    anchor: bool = False  # what the others rejoin (the PS, a shard): none is started again once it ended for good


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


class Supervisor:
    """Starts processes, prefixes their output, starts a failed one again while its spec's
    `restarts` last, stops them all on any other failure or on a signal. With `state_dir`, what
    it knows of each process goes to its state file on every change (backends/local/states.py)."""

    def __init__(
        self,
        specs: list[ProcessSpec],
        *,
        keep_going: bool = False,
        out: Optional[IO[str]] = None,
        grace: float = STOP_GRACE_SECONDS,
        restart_delay: float = RESTART_DELAY_SECONDS,
        pass_fds: tuple[int, ...] = (),
        state_dir: Optional[Path] = None,
    ) -> None:
        self.specs = specs
        self.pass_fds = pass_fds
        self.keep_going = keep_going
        self.out = out or sys.stdout
        self.grace = grace
        self.restart_delay = restart_delay
        self.state_dir = state_dir
        self.width = max(len(s.name) for s in specs)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._signal: Optional[int] = None
        self._mute = False
        self._states: dict[str, dict[str, Any]] = {}

    def run(self) -> int:
        restore = self._install_signal_handlers()
        procs: dict[str, subprocess.Popen] = {}
        readers: list[threading.Thread] = []
        codes: dict[str, int] = {}  # each process's exit status once it ended for good
        by_name = {spec.name: spec for spec in self.specs}
        restarted: dict[str, int] = {}
        due: dict[str, float] = {}  # a failed process -> when it starts again (monotonic)

        def start(spec: ProcessSpec) -> None:
            # Its own session: our signals, not the terminal's, stop it.
            p = spawn(spec.argv, spec.env, stdout=subprocess.PIPE, new_session=True, pass_fds=self.pass_fds)
            procs[spec.name] = p
            self._note(spec.name, pid=p.pid, status="running", restarts=restarted.get(spec.name, 0))
            readers.append(threading.Thread(target=self._pump, args=(spec.name, p.stdout), daemon=True))
            readers[-1].start()

        try:
            for spec in self.specs:
                if self._stop.is_set():
                    break
                start(spec)
            failed = False
            while len(codes) < len(procs):
                for name in [n for n, when in due.items() if when <= time.monotonic()]:
                    del due[name]
                    start(by_name[name])
                for name, p in list(procs.items()):
                    if name in codes or name in due or p.poll() is None:
                        continue
                    code, spec = p.returncode, by_name[name]
                    n = restarted.get(name, 0)
                    # A worker is not started again once the PS (an anchor) has ended for good:
                    # nothing to rejoin.
                    anchor_ended = any(by_name[m].anchor for m in codes)
                    if (
                        code not in (0, 2)
                        and n < spec.restarts
                        and not self._stop.is_set()
                        and (spec.anchor or not anchor_ended)
                    ):
                        restarted[name] = n + 1
                        self._say(name, f"exited with code {code}; restarting ({n + 1} of {spec.restarts})")
                        self._note(name, status="restarting", exit_code=code)
                        due[name] = time.monotonic() + self.restart_delay
                        continue
                    codes[name] = code
                    self._note(name, status="exited", exit_code=code)
                    self._say(name, f"exited with code {code}")
                    failed = failed or code != 0
                if self._stop.is_set() or (failed and not self.keep_going):
                    break
                self._stop.wait(0.1)
        finally:
            for name in due:  # stopped before its restart: it ended as it last exited
                codes[name] = procs[name].returncode
                self._note(name, status="exited")
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

    def _note(self, name: str, **what: Any) -> None:
        """Record what changed of process `name`, and write the state file (with `state_dir`)."""
        self._states.setdefault(name, {"pid": None, "status": "created", "exit_code": None, "restarts": 0})
        self._states[name].update(what)
        if self.state_dir is not None:
            states.write(self.state_dir, os.getpid(), self._states)

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
            self._note(name, status="exited", exit_code=p.returncode)
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
