"""One live `local` run per name on a host: runs/<name>/local.lock, held with flock(2) while
the run lives; and one `up` at a time per name and target: runs/<name>/up.lock (`starting`).

`local` takes the lock before it starts anything and hands it to the processes it starts, so
the lock is held as long as the orchestrator or any process of its run lives, and the kernel
drops it when the last of them ends, however it ends (a killed run leaves a file no one holds,
which never blocks). The file says who took it: the orchestrator's pid and the run's id, for
the one line that refuses a second run of the name.
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional

from orchestrator.errors import UsageError
from orchestrator.hints import command
from orchestrator.pids import alive

LOCK_FILE = "local.lock"
STARTING_FILE = "up.lock"  # prefixed by the target's verbs: stack-up.lock


@contextmanager
def starting(run_dir: Path, verb: str, what: str) -> Iterator[None]:
    """Held while `verb` (`up`, `stack-up`) checks that `what` (e.g. `project cpu-smoke`) has no
    live run and creates one: a second one of the name at that moment is refused in one line
    (UsageError) instead of passing the same check. Not inherited by what it starts; the kernel
    drops it however this process ends."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / f"{verb}.lock"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise UsageError(f"{path}: cannot open: {e.strerror or e}") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = _read(fd).get("pid")
            by = f" (orchestrator pid {pid})" if isinstance(pid, int) and alive(pid) else ""
            raise UsageError(
                f"{verb}: another {verb} of {what} is starting it now{by}; let it finish, then "
                f"{command(verb.removesuffix('up') + 'status')} shows its run (or give this one another name: --name)"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps({"pid": os.getpid()}) + "\n").encode(), 0)
        yield
    finally:
        os.close(fd)


def hold(run_dir: Path, run_id: str, name: str) -> int:
    """Take the lock of `run_dir` for run `run_id`: its file descriptor, inheritable (pass it to
    the run's processes); UsageError naming the live run when another holds it."""
    path = run_dir / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise UsageError(f"{path}: cannot open: {e.strerror or e}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        owner = _read(fd)
        os.close(fd)  # before looking for the holders: this process is not one
        raise UsageError(busy_line(run_dir, owner, holders(path), name)) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps({"pid": os.getpid(), "run_id": run_id}) + "\n").encode(), 0)
    os.set_inheritable(fd, True)
    return fd


def live_run(run_dir: Path) -> Optional[str]:
    """The id of the live `local` run of `run_dir` (its lock held; "" when its file names no
    id); None when none lives. Looks without waiting: the lock is taken and let go at once."""
    try:
        fd = os.open(run_dir / LOCK_FILE, os.O_RDONLY)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return str(_read(fd).get("run_id") or "")
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def _read(fd: int) -> dict[str, Any]:
    try:
        found = json.loads(os.pread(fd, 4096, 0).decode("utf-8", "replace") or "{}")
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def holders(path: Path) -> list[int]:
    """The pids of the processes that have `path` open (from /proc; [] where there is none)."""
    target = str(path.resolve())
    found = []
    proc = Path("/proc")
    for entry in proc.iterdir() if proc.is_dir() else []:
        if not entry.name.isdigit():
            continue
        try:
            fds = list((entry / "fd").iterdir())
        except OSError:  # gone, or not ours to read
            continue
        if target in (_link(fd) for fd in fds):
            found.append(int(entry.name))
    return sorted(found)


def _link(fd: Path) -> str:
    """Where an open file descriptor of /proc/<pid>/fd points; "" for one closed meanwhile (a
    process that opens and closes files as it is read is still read whole)."""
    try:
        return os.readlink(fd)
    except OSError:
        return ""


def busy_line(run_dir: Path, owner: dict[str, Any], pids: list[int], name: str) -> str:
    """The one line that refuses a second `local` of a name whose run is live."""
    run = owner.get("run_id") or "(id unknown)"
    pid = owner.get("pid")
    if isinstance(pid, int) and alive(pid):
        who = f"orchestrator pid {pid}; stop it with Ctrl-C in its terminal or kill {pid}"
    else:
        left = " ".join(str(p) for p in pids) or "unknown"
        gone = f"its orchestrator (pid {pid}) is gone" if isinstance(pid, int) else "its orchestrator is gone"
        who = f"{gone}, its processes still run: pids {left}"
    return (
        f"local: {run_dir}/ has a live run {run} ({who}); give this one another name "
        f"({command('local', NAME=name[:48] + '-2')})"
    )
