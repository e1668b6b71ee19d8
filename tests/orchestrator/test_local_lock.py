"""`orchestrator local` on a shared host, with real processes (a stand-in app that sleeps):
one live run per name (runs/<name>/local.lock), a killed run never blocks the next, and a
closed terminal (SIGHUP) stops every process of the run, as Ctrl-C does."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from test_cli_local import _orchestrator, fake_app  # noqa: F401 - fake_app is a fixture

from needs import host_has

NAMES = ("ps", "worker1", "worker2")
pytestmark = host_has(hasattr(os, "openpty"), "a pseudo-terminal and flock")


def _started(where: Path, p: subprocess.Popen) -> list[int]:
    """Once every process of the run has started: their pids."""
    deadline = time.monotonic() + 30
    while not all((where / f"{n}.json").exists() for n in NAMES):
        assert time.monotonic() < deadline and p.poll() is None, "the run did not start"
        time.sleep(0.1)
    for n in NAMES:
        (where / f"{n}.json").rename(where / f"{n}.started")
    return [json.loads((where / f"{n}.started").read_text())["pid"] for n in NAMES]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z" if Path("/proc").is_dir() else True


def _kill(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _local(where: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", "local", "-c", "topo.yaml", *args],
        cwd=where,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_second_local_of_a_live_name_is_refused_naming_the_live_run(fake_app: Path) -> None:  # noqa: F811
    first = _orchestrator(fake_app, "local", "-c", "topo.yaml", FAKE_SLEEP="1")
    pids: list[int] = []
    try:
        pids = _started(fake_app, first)
        run = json.loads((fake_app / "runs" / "t" / "local.lock").read_text())["run_id"]
        second = _local(fake_app)
        assert second.returncode == 2 and second.stdout == "", second.stdout + second.stderr
        assert second.stderr == (
            f"error: local: runs/t/ has a live run {run} (orchestrator pid {first.pid}; stop it with Ctrl-C in its "
            f"terminal or kill {first.pid}); give this one another name (make local NAME=t-2)\n"
        )
        assert not any((fake_app / f"{n}.json").exists() for n in NAMES), "the refused run started processes"

        other = _local(fake_app, "--name", "t-2")  # another name runs beside it
        assert other.returncode == 0, other.stderr
        assert "local: t-2: ps + 2 workers" in other.stdout and (fake_app / "runs" / "t-2" / "checkpoints").is_dir()
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=30)
        _kill(pids)
    assert first.returncode == 128 + signal.SIGTERM
    again = _local(fake_app)  # ended: the name is free
    assert again.returncode == 0, again.stderr


def test_a_killed_run_never_blocks_the_next_but_its_live_processes_do(fake_app: Path) -> None:  # noqa: F811
    # Processes that ignore the SIGTERM their launcher's death sends them (test_cli_local.py: the
    # others end with it), so they outlive it.
    first = _orchestrator(fake_app, "local", "-c", "topo.yaml", FAKE_SLEEP="1", FAKE_IGNORE_TERM="1")
    pids = _started(fake_app, first)
    try:
        first.kill()  # the orchestrator alone: its processes (sessions of their own) go on
        first.communicate(timeout=30)
        refused = _local(fake_app)
        assert refused.returncode == 2 and len(refused.stderr.splitlines()) == 1, refused.stderr
        assert f"its orchestrator (pid {first.pid}) is gone, its processes still run: pids " in refused.stderr
        assert set(pids) <= {int(p) for p in refused.stderr.split("pids ")[1].split(")")[0].split()}
    finally:
        _kill(pids)
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    again = _local(fake_app)  # every process of it killed: its lock file holds no one
    assert again.returncode == 0, again.stderr
    assert (fake_app / "runs" / "t" / "local.lock").is_file()


# The orchestrator as a shell starts it: in a session whose controlling terminal is a
# pseudo-terminal, so that closing the terminal (its master) sends it SIGHUP.
ON_A_TERMINAL = (
    "import fcntl, os, sys, termios\n"
    "fcntl.ioctl(0, termios.TIOCSCTTY, 0)\n"
    "os.execv(sys.executable, [sys.executable, '-m', 'orchestrator', *sys.argv[1:]])\n"
)


def test_a_closed_terminal_stops_every_process_of_a_local_run(fake_app: Path) -> None:  # noqa: F811
    master, terminal = os.openpty()
    p = subprocess.Popen(
        [sys.executable, "-c", ON_A_TERMINAL, "local", "-c", "topo.yaml"],
        cwd=fake_app,
        env={**os.environ, "FAKE_SLEEP": "1"},
        stdin=terminal,
        stdout=terminal,
        stderr=terminal,
        start_new_session=True,
    )
    os.close(terminal)
    pids: list[int] = []
    try:
        pids = _started(fake_app, p)
        time.sleep(0.3)
        os.close(master)  # the terminal window closes: SIGHUP to its session's leader
        p.wait(timeout=30)
        assert p.returncode == 128 + signal.SIGHUP, p.returncode
        orphans = [pid for pid in pids if _alive(pid)]
        assert not orphans, f"processes of the run left running after the terminal closed: {orphans}"
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        _kill(pids)
    assert not (fake_app / "runs" / "t" / "local.lock").exists() or _local(fake_app).returncode == 0


def test_up_of_a_name_whose_local_run_is_live_is_refused(fake_app: Path) -> None:  # noqa: F811
    import pytest

    from orchestrator.backends.base import Cluster
    from orchestrator.backends.registry import get
    from orchestrator.errors import UsageError
    from orchestrator.verbs import cluster as verbs

    first = _orchestrator(fake_app, "local", "-c", "topo.yaml", FAKE_SLEEP="1")
    pids: list[int] = []
    try:
        pids = _started(fake_app, first)
        run = json.loads((fake_app / "runs" / "t" / "local.lock").read_text())["run_id"]
        with pytest.raises(UsageError, match=rf"^up: a local run {run} of t is live \(runs/t/local.lock\)"):
            verbs.refuse_live(get("compose"), Cluster("t", fake_app / "runs" / "t" / "compose.yaml"), "up")
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=30)
        _kill(pids)
