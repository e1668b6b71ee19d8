"""The soak's probes (orchestrator/chaos/soak_job.py `SoakJob.probe`) when the engine hands back an
exec's exit status without its output: one that only reads is run again, one that changed
something is not and says so."""

from __future__ import annotations

from typing import Any, cast

import pytest

from orchestrator.chaos.soak_job import PROBE_TRIES, SoakJob


class Container:
    """A container whose first `lost` execs end 0 with their output lost."""

    name = "psc-soak-1a2b3c-pidns-1"

    def __init__(self, lost: int) -> None:
        self.lost, self.calls = lost, []

    def exec_run(self, cmd: list[str], user: str) -> tuple[int, bytes]:
        self.calls.append(cmd[3:])
        if len(self.calls) <= self.lost:
            return 0, b""
        return 0, b'{"files": [], "procs": {}}\n'


def probe(container: Container, command: str, *args: str) -> Any:
    return SoakJob.probe(cast(SoakJob, None), container, command, *args)


def test_a_reading_probe_whose_output_the_engine_lost_is_run_again():
    container = Container(lost=PROBE_TRIES - 1)
    assert probe(container, "shm", "/dev/shm", "/proc") == {"files": [], "procs": {}}
    assert container.calls == [["shm", "/dev/shm", "/proc"]] * PROBE_TRIES


def test_a_probe_that_changed_something_is_not_run_again_and_says_its_output_was_lost():
    container = Container(lost=1)
    with pytest.raises(RuntimeError, match=r"^soak probe fill in psc-soak-1a2b3c-pidns-1: exit 0, and the engine"):
        probe(container, "fill", "/state/fill", "3.0")
    assert container.calls == [["fill", "/state/fill", "3.0"]]


def test_a_reading_probe_lost_every_time_is_one_error_after_its_tries():
    container = Container(lost=PROBE_TRIES)
    with pytest.raises(RuntimeError, match="no output"):
        probe(container, "audit", "/state", "/state/checkpoints")
    assert len(container.calls) == PROBE_TRIES
