"""A run's secret and private socket directory: made private, and gone even when the launcher
that made them was killed."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

from orchestrator import job_secret

from needs import host_has
from orch_helpers import REPO

# Enters a private exchange for the run directory argv[1], prints the socket directory and waits.
HOLDER = r"""
import sys, time
from pathlib import Path
from orchestrator import job_secret
with job_secret.private_exchange(Path(sys.argv[1])) as env:
    print(env[job_secret.SOCKET_DIR_ENV], flush=True)
    time.sleep(600)
"""


def hold(run_dir: Path) -> tuple[subprocess.Popen[str], Path]:
    """A launcher that holds a private exchange, and its socket directory."""
    run_dir.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(run_dir)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    return proc, Path(proc.stdout.readline().strip())


def test_the_secret_and_socket_directory_are_the_run_users_alone_and_go_with_the_run(tmp_path: Path) -> None:
    with job_secret.private_exchange(tmp_path) as env:
        secret, sockets = Path(env[job_secret.SECRET_ENV]), Path(env[job_secret.SOCKET_DIR_ENV])
        assert stat.S_IMODE(secret.stat().st_mode) == 0o600
        assert stat.S_IMODE(sockets.stat().st_mode) == 0o700
        assert sockets.name.startswith(f"psc-{os.getpid()}-")
        assert len(secret.read_text().strip()) == 2 * job_secret.SECRET_BYTES
    assert not secret.exists() and not sockets.exists()


def test_a_killed_launchers_socket_directory_goes_at_the_next_run_of_any_name(tmp_path: Path) -> None:
    killed, left = hold(tmp_path / "a")
    live, kept = hold(tmp_path / "b")
    try:
        killed.send_signal(signal.SIGKILL)
        killed.wait(10)
        assert left.is_dir()  # nothing of the killed launcher removed it
        (tmp_path / "c").mkdir()
        with job_secret.private_exchange(tmp_path / "c"):
            assert not left.exists()
            assert kept.is_dir()  # a live launcher's stays
    finally:
        for proc in (killed, live):
            proc.kill()
            proc.wait(10)


@host_has(os.getuid() == 0, "root, to make a directory another account owns")
def test_another_accounts_directory_or_a_link_is_not_touched(tmp_path: Path) -> None:
    root = tmp_path / "tmp"
    root.mkdir()
    gone_pid = 2**22 + 1  # above the kernel's pid_max ceiling: no such process
    theirs = root / f"psc-{gone_pid}-theirs"
    theirs.mkdir()
    os.chown(theirs, 65534, 65534)
    target = tmp_path / "precious"
    target.mkdir()
    link = root / f"psc-{gone_pid}-link"
    link.symlink_to(target)
    mine = root / f"psc-{gone_pid}-mine"
    mine.mkdir()
    assert job_secret.remove_stale_sockets(root) == [mine]
    assert theirs.is_dir() and link.is_symlink() and target.is_dir()
