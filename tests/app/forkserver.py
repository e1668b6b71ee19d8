"""`python -m app ARGV` for the tests, forked from a process that has imported torch already.

Each app process a test starts pays `import torch` (and torchvision, tensorboard): about
3 CPU-seconds on a 2-core CPU VM, a third of the suite's CPU time over its ~400 processes.
Here one server per test process imports them once, then forks each app process from that
state: the test sends the argv, environment, working directory and its stdio descriptors over
a Unix socket; the server forks twice and the app process, orphaned at once, is reparented to
the test process (a child subreaper while it asks), so the test waits for it, signals it and
reads its exit status as a `subprocess.Popen`'s. In the child: the environment, directory, stdio, `sys.path`
and `sys.argv` of `python -m app`, then `app/__main__.py` run as `__main__`; its exit is the
interpreter's own (atexit handlers, buffers flushed).

What a fork cannot give, the tests that need it start by exec (`start_app(..., fork=False)`):
a signal's disposition set before the app starts (`preexec_fn`), anything read from the
environment while torch loads, a command line of `-m app` for `pgrep`. TESTS_EXEC_APP=1 makes
every start an exec (to check that a result does not depend on the fork).

The server has imported modules only: no thread of its own but OpenBLAS's pool, which OpenBLAS
stops before a fork and starts again after it; nothing has computed, so torch's OpenMP pool does
not exist yet.
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import json
import os
import select
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
PRELOAD = ("numpy", "torch", "zmq", "torch.optim", "torch.utils.tensorboard", "torchvision")
PR_SET_CHILD_SUBREAPER = 36
HEADER = struct.Struct("!I")


def can_fork(env: dict[str, str]) -> bool:
    """False under TESTS_EXEC_APP=1, when ENV's OMP_NUM_THREADS is not the server's, or when its
    PYTHONPATH puts a module of its own in place of one the server has imported already (a
    test's stand-in for torchvision)."""
    if os.environ.get("TESTS_EXEC_APP") == "1":
        return False
    if env.get("OMP_NUM_THREADS") != os.environ.get("OMP_NUM_THREADS"):
        return False  # OpenMP read it once, as the server imported torch
    preloaded = {module.split(".")[0] for module in PRELOAD}
    entries = [entry for entry in env.get("PYTHONPATH", "").split(os.pathsep) if entry]
    return not any(
        os.path.exists(os.path.join(entry, name + suffix))
        for entry in entries
        for name in preloaded
        for suffix in ("", ".py")
    )


# --- the test's side ------------------------------------------------------------


class ForkedApp:
    """A forked app process, waited for and signalled as a `subprocess.Popen` is."""

    def __init__(self, args: list[str], pid: int) -> None:
        self.args = args
        self.pid = pid
        self.returncode: int | None = None
        self._pidfd = os.pidfd_open(pid)

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self._ended(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            ready, _, _ = select.select([self._pidfd], [], [], timeout)
            if not ready:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._ended(os.waitpid(self.pid, 0)[1])
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(15)

    def kill(self) -> None:
        self.send_signal(9)

    def _ended(self, status: int) -> None:
        self.returncode = os.waitstatus_to_exitcode(status)
        os.close(self._pidfd)


class _Server:
    """This test process's fork server, started on first use and stopped at its exit."""

    def __init__(self) -> None:
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.dir = tempfile.mkdtemp(prefix="app-forkserver-")
        self.path = os.path.join(self.dir, "socket")
        env = {k: v for k, v in os.environ.items() if not k.startswith("PSC_")}
        env["PYTHONPATH"] = str(REPO)
        self.proc = subprocess.Popen([sys.executable, __file__, self.path], env=env, cwd=REPO, stdin=subprocess.DEVNULL)
        self.lock = threading.Lock()
        atexit.register(self.stop)

    def connect(self) -> socket.socket:
        deadline = time.monotonic() + 120
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(self.path)
                return sock
            except (FileNotFoundError, ConnectionRefusedError):
                sock.close()
                if self.proc.poll() is not None:
                    raise RuntimeError(f"the app's fork server exited {self.proc.returncode}") from None
                if time.monotonic() > deadline:
                    raise TimeoutError("the app's fork server did not listen within 120 s") from None
                time.sleep(0.05)

    def spawn(self, request: dict, stdio: tuple[int, int, int]) -> int:
        message = json.dumps(request).encode()
        with self.lock, self.connect() as sock:
            # A subreaper only while the server forks: the orphan it makes comes here, and the
            # orphans of anything else, at other times, go to init as they would (here they would
            # stay zombies until the test process ends, and `kill -0` finds a zombie alive).
            self._subreaper(1)
            try:
                socket.send_fds(sock, [HEADER.pack(len(message)) + message], list(stdio))
                reply = b""
                while chunk := sock.recv(64):
                    reply += chunk
            finally:
                self._subreaper(0)
        if not reply:
            raise RuntimeError("the app's fork server gave no process")
        return int(reply)

    def _subreaper(self, on: int) -> None:
        if self.libc.prctl(PR_SET_CHILD_SUBREAPER, on, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


_SERVER: _Server | None = None


def start(
    argv: list[str],
    env: dict[str, str],
    cwd: Path,
    stdout: int,
    stderr: int,
    stdin: int = 0,
    module: str = "app",
    new_session: bool = False,
) -> ForkedApp:
    """`python -m MODULE ARGV` with ENV in CWD, its output to the descriptors STDOUT and STDERR
    (`new_session`: in a session of its own, as Popen's start_new_session)."""
    global _SERVER
    if _SERVER is None:
        _SERVER = _Server()
    request = {"argv": argv, "env": env, "cwd": str(cwd), "module": module, "session": new_session}
    pid = _SERVER.spawn(request, (stdin, stdout, stderr))
    return ForkedApp([sys.executable, "-m", module, *argv], pid)


FORKED_MODULES = ("app", "bench.node")


def _module(argv: list[str]) -> str | None:
    """The module of a `python -m MODULE ...` this server can fork, else None."""
    if len(argv) > 2 and argv[:2] == [sys.executable, "-m"] and argv[2] in FORKED_MODULES:
        return argv[2]
    return None


def _forked(argv: list[str], env: dict[str, str], stdout: Any, stderr: Any, **how: Any) -> ForkedApp:
    """ARGV forked, its output to the files STDOUT and STDERR (subprocess.STDOUT: the same)."""
    out = stdout.fileno()
    err = out if stderr == subprocess.STDOUT else stderr.fileno()
    return start(argv[3:], env, Path.cwd(), out, err, module=argv[2], **how)


def popen(argv: list[str], *, stdout: Any, stderr: Any, env: dict[str, str], start_new_session: bool = False):
    """subprocess.Popen, with `python -m app` and `python -m bench.node` forked (bench/procs.py)."""
    if _module(argv) is None or not can_fork(env):
        return subprocess.Popen(argv, stdout=stdout, stderr=stderr, env=env, start_new_session=start_new_session)
    return _forked(argv, env, stdout, stderr, new_session=start_new_session)


def spawn(
    argv: list[str],
    env: dict[str, str],
    *,
    stdout: Any,
    stderr: Any = subprocess.STDOUT,
    new_session: bool = False,
    pass_fds: tuple[int, ...] = (),
) -> subprocess.Popen | ForkedApp:
    """orchestrator.verbs.local.spawn (the same signature: it stands in for it), with `python -m app`
    forked unless descriptors are passed on."""
    from orchestrator.verbs import local

    full = {**os.environ, "PYTHONUNBUFFERED": "1", **env}  # what local.spawn gives the process
    if _module(argv) is None or pass_fds or not can_fork(full):
        return local.spawn(argv, env, stdout=stdout, stderr=stderr, new_session=new_session, pass_fds=pass_fds)
    with open(os.devnull) as devnull:
        return _forked(argv, full, stdout, stderr, stdin=devnull.fileno(), new_session=new_session)


def run(argv: list[str], env: dict[str, str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """subprocess.run's capture_output=True, text=True, for a forked `python -m app ARGV`."""
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    try:
        proc = start(argv, env, cwd, out_w, err_w)
    finally:
        os.close(out_w)
        os.close(err_w)
    read: dict[int, list[bytes]] = {out_r: [], err_r: []}
    readers = [threading.Thread(target=_drain, args=(fd, read[fd]), daemon=True) for fd in read]
    for reader in readers:
        reader.start()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    finally:
        for reader in readers:
            reader.join()
    out, err = (_text(b"".join(read[fd])) for fd in (out_r, err_r))
    assert proc.returncode is not None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _drain(fd: int, into: list[bytes]) -> None:
    with open(fd, "rb", closefd=True) as pipe:
        into.append(pipe.read())


def _text(data: bytes) -> str:
    return data.decode().replace("\r\n", "\n").replace("\r", "\n")


# --- the server's side ------------------------------------------------------------


def _serve(path: str) -> tuple[dict, list[int]] | None:
    """Answer each request with a forked app process's pid; in that process, return its request."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(8)
    parent = os.getppid()
    while True:
        if not select.select([listener], [], [], 1.0)[0]:
            if os.getppid() != parent:  # the test process is gone: so is this server
                os._exit(0)
            continue
        conn, _ = listener.accept()
        with conn:
            data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
            (size,) = HEADER.unpack_from(data)
            while len(data) < HEADER.size + size:
                data += conn.recv(1 << 20)
            request = json.loads(data[HEADER.size :])
            pid = _fork_orphan()
            if pid is None:  # the app process
                listener.close()
                return request, fds
            for fd in fds:
                os.close(fd)
            conn.sendall(str(pid).encode())


def _fork_orphan() -> int | None:
    """Fork a process whose parent exits at once (it goes to the test process, the subreaper):
    its pid here, None in it."""
    r, w = os.pipe()
    middle = os.fork()
    if middle == 0:
        pid = os.fork()
        if pid == 0:
            os.close(r)
            os.close(w)
            return None
        os.write(w, str(pid).encode())
        os._exit(0)
    os.close(w)
    with open(r, "rb") as pipe:
        pid = int(pipe.read())
    os.waitpid(middle, 0)
    return pid


def _become_app(request: dict, fds: list[int]) -> None:
    """This process as `python -m MODULE ARGV` started with the request's environment and directory."""
    import io
    import runpy
    import signal

    import numpy

    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    for name, fd, mode in (("stdin", 0, "r"), ("stdout", 1, "w"), ("stderr", 2, "w")):
        raw = open(fd, mode + "b", buffering=0 if unbuffered and fd else -1, closefd=False)
        stream = io.TextIOWrapper(
            raw,
            errors="backslashreplace" if fd == 2 else None,
            line_buffering=fd == 2 or (fd == 1 and os.isatty(1)),
            write_through=unbuffered and fd > 0,
        )
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)
    # sys.path as `python -m` gives it: the directory, then PYTHONPATH, then the interpreter's own.
    own = [p for p in sys.path if p not in (str(REPO), os.path.dirname(os.path.abspath(__file__)))]
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [os.getcwd(), *extra, *own]
    numpy.random.seed()  # a fresh interpreter's global generator is seeded from the OS
    if request["session"]:
        os.setsid()
    sys.argv = ["-m", *request["argv"]]
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)


def _main(path: str) -> None:
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # what app/__main__.py sets before torch loads
    import importlib

    for module in PRELOAD:
        importlib.import_module(module)
    # What is there now stays for every child: their collections and their exit skip it (an exit
    # that tore it down took ~1 CPU-s a child: every page it touched copied).
    gc.collect()
    gc.freeze()
    served = _serve(path)
    assert served is not None
    _become_app(*served)


if __name__ == "__main__":
    sys.path.remove(os.path.dirname(os.path.abspath(__file__)))
    _main(sys.argv[1])
