"""The chaos faults' job as local processes (orchestrator/chaos/processes.py ProcessJob): with
`restart`, a process that fails is started again as compose's `restart: on-failure` does, and
the blocks the faults read (restarts, failures, ended) say so. The processes are stand-ins
(subprocess.Popen replaced): the faults themselves run the app in tests/failure/."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from orchestrator.chaos.processes import ProcessJob
from orchestrator.paths import SMOKE_CONFIG
from orchestrator.topology.model import load

from orch_helpers import REPO


class Stand:
    """A process that ends with the status the test gives it (None: running)."""

    made: list[Stand] = []

    def __init__(self, argv, env, **kwargs) -> None:
        self.name = f"worker{env['PSC_RANK']}" if argv[-1] == "worker" else "ps"
        self.returncode: int | None = None
        self.pid = 10_000 + len(Stand.made)
        Stand.made.append(self)

    def poll(self) -> int | None:
        return self.returncode

    def kill(self) -> None:
        self.returncode = -9

    def wait(self, timeout: float | None = None) -> int | None:
        return self.returncode


@pytest.fixture
def stand_ins(monkeypatch: pytest.MonkeyPatch):
    Stand.made = []
    monkeypatch.setattr(subprocess, "Popen", Stand)
    return Stand.made


def _until(check, seconds: float = 10.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return False


def test_a_failed_process_is_started_again_and_counted_but_not_a_clean_exit_or_a_mistake(stand_ins, tmp_path: Path):
    job = ProcessJob(load(str(REPO / SMOKE_CONFIG)), tmp_path / "a" / "new" / "run", restart=True)
    try:
        job.start("worker1", "worker2")
        first = {p.name: p for p in stand_ins}
        before = time.time()
        first["worker1"].returncode = 1
        first["worker2"].returncode = 2  # a mistake in the input: said once, not retried
        assert _until(lambda: len(stand_ins) == 3)
        assert job.restarts("worker1") == 1 and job.restarts("worker2") == 0
        code, seen = job.failures(before)["worker1"]
        assert code == 1 and seen >= before and "worker2" not in job.failures(before)
        assert (tmp_path / "a" / "new" / "run" / "logs" / "worker1.2.err").exists()
        stand_ins[-1].returncode = 0
        assert job.ended(timeout=10) == {"worker1": 0, "worker2": 2}
    finally:
        job.close()


def test_without_restart_a_failed_process_stays_ended(stand_ins, tmp_path: Path):
    job = ProcessJob(load(str(REPO / SMOKE_CONFIG)), tmp_path)
    try:
        job.start("worker1")
        stand_ins[0].returncode = 1
        time.sleep(1.0)
        assert len(stand_ins) == 1 and job.restarts("worker1") == 0
        assert job.ended(timeout=5) == {"worker1": 1}
    finally:
        job.close()
