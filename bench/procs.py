"""Starting a case's processes, bounded by a timeout, always cleaned up; CPU use from /proc."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
# How a case's process starts: the tests put a fork in its place (tests/app/forkserver.py).
popen: Callable[..., subprocess.Popen] = subprocess.Popen


class CaseFailed(RuntimeError):
    """A process of a case failed or outlived its timeout."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job_paths(tmp: Path) -> dict[str, str]:
    """Where the app's processes of one case find what they share (`job_files`)."""
    return {"secret_file": str(tmp / "secret"), "socket_dir": str(tmp / "sockets")}


def job_files(tmp: Path) -> dict[str, str]:
    """What the app's processes of one case share, as `make local` gives a run, made in `tmp`: a
    new secret (0600: --secret_file) and a directory for their UNIX sockets (0700: --socket_dir)."""
    from app.exchange import secret

    paths = job_paths(tmp)
    secret.make(paths["secret_file"])
    os.mkdir(paths["socket_dir"], mode=0o700)
    return paths


def app_flags(files: dict[str, str]) -> list[str]:
    """The flags of `python -m app` that give a process the case's `job_files`."""
    return ["--secret_file", files["secret_file"], "--socket_dir", files["socket_dir"]]


def cpu_seconds(pid: int) -> float:
    """utime + stime of every thread of `pid`, from /proc/<pid>/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def idle_cpu_percent(pids: dict[str, int], seconds: float) -> dict[str, float]:
    """Percent of one core each process used over `seconds`."""
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    t0 = time.monotonic()
    time.sleep(seconds)
    elapsed = time.monotonic() - t0
    return {name: round(100 * (cpu_seconds(pid) - before[name]) / elapsed, 1) for name, pid in pids.items()}


@dataclass
class Case:
    system: str  # a key of bench.node.SYSTEMS
    model: str
    workers: int


# free_port() picks a port the kernel had free; on a busy host another process can take it
# before the PS binds it (EADDRINUSE). Such a case runs again on a new port, once.
PORT_TRIES = 2


def run_case(case: Case, params: dict[str, Any], timeout: float, idle_seconds: float = 0.0) -> dict[str, Any]:
    """PS + workers of one case; the PS's and each worker's result, and idle CPU if asked."""
    for _ in range(PORT_TRIES - 1):
        try:
            return _run_case_once(case, params, timeout, idle_seconds)
        except CaseFailed as error:
            if "EADDRINUSE" not in str(error):
                raise
            print(f"bench: {case.system}: its port was taken before the PS bound it; again on another", file=sys.stderr)
    return _run_case_once(case, params, timeout, idle_seconds)


def _run_case_once(case: Case, params: dict[str, Any], timeout: float, idle_seconds: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        marker = str(Path(tmp) / "idle") if idle_seconds else None
        base = dict(
            params,
            world_size=case.workers + 1,
            port=free_port(),
            model=case.model,
            idle_marker=marker,
            idle_seconds=idle_seconds + 1.0,
            timeout=timeout,
        )
        procs: dict[str, subprocess.Popen] = {}
        logs: dict[str, Any] = {}
        try:
            _start_nodes(case, params, base, Path(tmp), procs, logs)
            idle = _measure_idle(procs, marker, idle_seconds, timeout) if marker else None
            deadline = time.monotonic() + timeout
            for name, proc in procs.items():
                code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
                if code != 0:
                    raise CaseFailed(f"{name} exited {code}: {_tail(logs[name])}")
            results = {name: json.loads((Path(tmp) / f"{name}.json").read_text()) for name in procs}
        except subprocess.TimeoutExpired:
            raise CaseFailed(
                f"did not finish within {timeout:.0f} s: " + "; ".join(f"{n}: {_tail(f)}" for n, f in logs.items())
            ) from None
        finally:
            for proc in procs.values():
                _kill_group(proc)
            for f in logs.values():
                f.close()
    if case.system.startswith("ref"):  # the reference PS returns its trainers' results
        results.update({f"worker{r}": w for r, w in results["ps"]["workers"].items()})
    return {
        "workers": [results[f"worker{r}"] for r in range(1, case.workers + 1)],
        "ps": results.get("ps", {}),
        "idle_cpu_percent": idle,
    }


def _start_nodes(
    case: Case,
    params: dict[str, Any],
    base: dict[str, Any],
    tmp: Path,
    procs: dict[str, subprocess.Popen],
    logs: dict[str, Any],
) -> None:
    """Starts each process of the case as `python -m bench.node`, each in a session of its own, writing
    tmp/<name>.log and its result to tmp/<name>.json; fills `procs` and `logs` as it goes, so the
    caller can clean up after a failed start."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", TP_SOCKET_IFNAME="lo")
    env.pop("OMP_NUM_THREADS", None)
    if params.get("threads"):  # the headline table: one thread per process
        env["OMP_NUM_THREADS"] = str(params["threads"])
    # PS shards (`shards` > 1) come after the workers in RPC rank: ps1 is workers + 1
    extra = params.get("shards", 1) - 1
    first = 1 if params.get("workers_only") else 0  # compute, allreduce: no rank 0 needed
    for rank in range(first, case.workers + 1 + extra):
        role = "ps" if rank == 0 else "worker" if rank <= case.workers else "shard"
        name = {"ps": "ps", "worker": f"worker{rank}", "shard": f"ps{rank - case.workers}"}[role]
        logs[name] = open(tmp / f"{name}.log", "w+b")
        argv = [
            sys.executable,
            "-m",
            "bench.node",
            case.system,
            role,
            json.dumps(dict(base, rank=rank)),
            str(tmp / f"{name}.json"),
        ]
        procs[name] = popen(argv, stdout=logs[name], stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _measure_idle(
    procs: dict[str, subprocess.Popen], marker: str, seconds: float, timeout: float
) -> dict[str, float] | None:
    deadline = time.monotonic() + timeout
    while not Path(marker).exists():
        if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs.values()):
            return None
        time.sleep(0.05)
    time.sleep(0.3)  # let the last reply settle
    return idle_cpu_percent({"ps": procs["ps"].pid, "worker": procs["worker1"].pid}, seconds)


def _tail(f: Any, lines: int = 3) -> str:
    f.flush()
    f.seek(0)
    text = f.read().decode(errors="replace").strip().splitlines()
    return " | ".join(text[-lines:]) or "no output"


def _kill_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)
