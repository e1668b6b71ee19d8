"""Two `up`s of one name at the same moment: the check for a live run and the start are one
`up` at a time (runs/<name>/up.lock, orchestrator.run_lock.starting), so the second is refused
in one line, exit 2, before it looks at the engine or renders anything. Before, both passed the
live-run check: one recreated the other's containers, the other failed with a raw daemon error.

Real processes: one holds the lock as an `up` in progress does (the same function), the other is
the real CLI, given a Docker host that cannot answer: refused by the lock, it never gets that far.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator import paths, run_lock
from orchestrator.errors import UsageError

from orch_helpers import REPO

HOLDER = """
import sys
from pathlib import Path
from orchestrator import run_lock
with run_lock.starting(Path(sys.argv[1]), "up", "project " + sys.argv[2]):
    print("held", flush=True)
    sys.stdin.read()
"""


@pytest.fixture
def name():
    name = f"up-lock-{os.getpid()}"
    yield name
    shutil.rmtree(paths.RUNS / name, ignore_errors=True)


def _up(name: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", "up", "-c", "configs/cpu-smoke.yaml", "--name", name],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "DOCKER_HOST": "tcp://127.0.0.1:1"},
    )


def test_a_second_up_of_a_name_being_started_is_refused_in_one_line(name: str) -> None:
    run_dir = paths.RUNS / name
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(run_dir), name], cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"held\n"
        second = _up(name)
    finally:
        holder.communicate(timeout=30)
    assert second.returncode == 2, second.stderr
    assert second.stderr.splitlines() == [
        f"error: up: another up of project {name} is starting it now (orchestrator pid {holder.pid}); let it "
        "finish, then make status shows its run (or give this one another name: --name)"
    ]
    assert not (run_dir / "compose.yaml").exists()  # nothing rendered, nothing started
    # the holder gone, its lock went with it: the next up gets past it (to the engine, here none)
    after = _up(name)
    assert after.returncode == 1 and "cannot reach the Docker daemon" in after.stderr, after.stderr


def test_the_lock_is_one_holder_at_a_time_and_free_once_left(tmp_path: Path) -> None:
    with run_lock.starting(tmp_path, "stack-up", "stack s"):
        busy = r"^stack-up: another stack-up of stack s is starting it now .*make stack-status"
        with pytest.raises(UsageError, match=busy):
            with run_lock.starting(tmp_path, "stack-up", "stack s"):
                pass
    with run_lock.starting(tmp_path, "stack-up", "stack s"):
        assert (tmp_path / "stack-up.lock").is_file()
