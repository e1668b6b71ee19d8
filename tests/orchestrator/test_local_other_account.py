"""Another account on the host cannot run code in, write to or stall a `local` run.

The run is real (PS + 2 workers on digits); the other account is `nobody` (uid 65534, set with
setpriv), which tries, while the job trains, every way in a local job offers: the directory of
its UNIX sockets and the PS's socket in it, the run's secret, any TCP port a process of the job
listens on (256 KiB of random bytes to each, and held open), and the PS's shared memory.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

from needs import host_has
from orch_helpers import REPO

NOBODY = 65534

# Run as nobody, with the paths to try as its arguments: what each attempt met, as JSON.
ATTACK = r"""
import json, os, socket, sys, time

socket_dir, secret, ports, shm = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
said = {}

def attempt(what, do):
    try:
        do()
        said[what] = "done"
    except OSError as error:
        said[what] = type(error).__name__

attempt("list the socket directory", lambda: os.listdir(socket_dir))
def connect_ps():
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(os.path.join(socket_dir, "ps.sock"))
        s.sendall(os.urandom(1 << 18))
attempt("connect to the PS's socket", connect_ps)
attempt("read the run's secret", lambda: open(secret, "rb").read())
attempt("replace the run's secret", lambda: open(secret, "wb").write(b"0" * 64))
for path in shm:
    attempt(f"write {path}", lambda: open(path, "r+b").write(b"\0" * 64))
held = []
for port in ports:
    def flood():
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        held.append(s)  # kept open while the job trains on
        s.sendall(os.urandom(1 << 18))
    attempt(f"flood tcp port {port}", flood)
print(json.dumps(said), flush=True)
time.sleep(5)
"""


def _children(parent: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == parent:
                found.append(int(entry.name))
        except (OSError, IndexError, ValueError):
            continue
    return found


def _listening_ports(pids: list[int]) -> list[int]:
    """The TCP ports the processes `pids` listen on (their sockets' inodes in /proc/net/tcp*)."""
    inodes = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").glob("*"):
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return sorted(ports)


def _shared_memory(pids: list[int]) -> list[str]:
    """The files under /dev/shm the processes `pids` map."""
    paths = set()
    for pid in pids:
        for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
            path = line.split(maxsplit=5)[-1] if len(line.split()) >= 6 else ""
            if path.startswith("/dev/shm/"):
                paths.add(path.removesuffix(" (deleted)"))
    return sorted(paths)


@pytest.mark.slow
@host_has(os.geteuid() == 0 and shutil.which("setpriv") is not None, "root and setpriv, to act as another account")
def test_another_account_cannot_reach_write_or_stall_a_local_run() -> None:
    # A working directory every account may enter, as a user's home or project often is: the
    # run's own modes are what keep others out, not the test's temporary directory.
    home = Path(tempfile.mkdtemp(prefix="psc-other-account-"))
    home.chmod(0o755)
    topo = yaml.safe_load((REPO / "configs/cpu-smoke.yaml").read_text())
    topo["train"]["epochs"] = 12
    (home / "topo.yaml").write_text(yaml.safe_dump(topo))
    p = subprocess.Popen(
        [sys.executable, "-m", "orchestrator", "local", "-c", "topo.yaml", "--workers", "2"],
        cwd=home,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    try:
        socket_dir = ""
        for line in p.stdout:  # until both workers train
            lines.append(line)
            found = re.search(r"on UNIX sockets in ([^\s,]+)", line)
            socket_dir = found.group(1) if found else socket_dir
            if re.match(r"worker2 +\| worker2 \| Epoch: 2 \| ", line):
                break
        assert socket_dir, "".join(lines[-50:])
        job = [pid for child in _children(p.pid) for pid in (child, *_children(child))]
        secret = home / "runs" / "cpu-smoke" / "secret"
        assert secret.is_file() and secret.stat().st_mode & 0o777 == 0o600
        ports, shm = _listening_ports(job), _shared_memory(job)
        attacker = subprocess.run(
            ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--"]
            + [sys.executable, "-c", ATTACK, socket_dir, str(secret), json.dumps(ports), json.dumps(shm)],
            capture_output=True,
            text=True,
            timeout=60,
            cwd="/",
        )
        assert attacker.returncode == 0, attacker.stderr
        said = json.loads(attacker.stdout)
        lines.extend(p.stdout)
        p.wait(timeout=600)
    finally:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            p.wait(timeout=60)
        shutil.rmtree(home, ignore_errors=True)
    out = "".join(lines)
    # The kernel refused every one, before a byte reached the job.
    assert said.pop("list the socket directory") == "PermissionError"
    assert said.pop("connect to the PS's socket") == "PermissionError"
    assert said.pop("read the run's secret") == "PermissionError"
    assert said.pop("replace the run's secret") == "PermissionError"
    assert shm, "the PS's shared memory was not found"
    for path in shm:
        assert said.pop(f"write {path}") == "PermissionError", path
    # A PS job listens on no TCP port at all; one there would have been flooded and held.
    assert ports == [] and said == {}, (ports, said)
    # ...and the job trained on, unstalled, to its usual accuracy.
    assert p.returncode == 0, out[-4000:]
    final = re.findall(r"^ps +\| Accuracy: ([0-9.]+)$", out, re.M)
    assert final and float(final[-1]) >= 0.90, out[-3000:]
    assert not Path(socket_dir).exists()  # the sockets' directory goes with the run
