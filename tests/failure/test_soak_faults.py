"""The soak's pause fault (orchestrator/chaos/soak_faults.py) judged against a job whose PS
records what a real one does: the drop of a frozen worker, then its `back` as soon as it runs
again. The engine thaws a container before its answer to `unpause` comes back, so the `back`
record can be older than the moment that answer arrives: the fault still counts it."""

from __future__ import annotations

import time
from typing import Any, cast

import pytest
from docker.errors import APIError

from orchestrator.chaos import soak_faults
from orchestrator.chaos.soak_faults import Context
from orchestrator.chaos.soak_job import SoakJob
from orchestrator.chaos.soak_plan import Step

ENGINE_ANSWER_S = 0.3  # from the thaw to the engine's answer to `unpause`


FREEZE_FAILED = APIError(
    '500 Server Error: Internal Server Error ("Cannot pause container 4b1c: OCI runtime pause failed: '
    'unable to freeze: unknown")'
)


class Worker:
    """A worker's container: paused, the PS drops it; thawed, it calls at once (`back`), and
    the engine answers the unpause call only ENGINE_ANSWER_S later. The first `unfrozen`
    pauses fail as runc's does when its freezer gives up."""

    def __init__(self, records: list[dict[str, Any]], comes_back: bool, unfrozen: int = 0) -> None:
        self.records, self.comes_back, self.unfrozen = records, comes_back, unfrozen
        self.pauses = 0

    def pause(self) -> None:
        self.pauses += 1
        if self.pauses <= self.unfrozen:
            raise FREEZE_FAILED
        self.records.append(ps_record("drop", 100))

    def unpause(self) -> None:
        if self.comes_back:
            self.records.append(ps_record("back", 120))
        time.sleep(ENGINE_ANSWER_S)


class Job:
    """The part of SoakJob the pause fault uses."""

    def __init__(self, comes_back: bool, unfrozen: int = 0) -> None:
        self.ps: list[dict[str, Any]] = [ps_record("start", 0)]
        self.worker = Worker(self.ps, comes_back, unfrozen)

    def running(self, prefix: str = "") -> list[str]:
        return [s for s in ("ps", "worker1") if s.startswith(prefix)]

    def containers(self) -> dict[str, Worker]:
        return {"worker1": self.worker}

    def records(self, name: str = "ps") -> list[dict[str, Any]]:
        return list(self.ps)


def ps_record(event: str, step: int) -> dict[str, Any]:
    fields = {"worker": "worker1", "worker_rank": 1} if event != "start" else {}
    return {"time": time.time(), "role": "ps", "rank": 0, "event": event, "step": step, **fields}


@pytest.fixture(autouse=True)
def quick_polls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(soak_faults, "POLL_S", 0.01)
    monkeypatch.setattr(soak_faults, "PAUSE_RETRY_S", 0.01)


def pause(job: Job) -> soak_faults.FaultResult:
    ctx = Context(count=1, most=1, rpc_timeout=0.1, recovery_s=1.0)
    return soak_faults.pause(cast(SoakJob, job), Step("pause", 0.0, 0.0, 0.05), ctx)


def test_a_worker_back_before_the_engine_answers_unpause_is_recovered():
    result = pause(Job(comes_back=True))

    assert result.recovered_s is not None, result.notes
    assert "back at version 120" in result.notes


def test_a_worker_that_never_calls_again_is_not_recovered():
    result = pause(Job(comes_back=False))

    assert result.recovered_s is None
    assert "dropped after" in result.notes and "not back within 1 s" in result.notes


def test_a_pause_runc_could_not_freeze_is_tried_again_and_the_fault_goes_on():
    job = Job(comes_back=True, unfrozen=2)
    result = pause(job)

    assert job.worker.pauses == 3 and result.recovered_s is not None, result.notes
    assert "(paused at try 3: runc could not freeze it before)" in result.notes


def test_a_pause_that_never_freezes_or_fails_otherwise_is_the_engines_error():
    job = Job(comes_back=True, unfrozen=soak_faults.PAUSE_TRIES)
    with pytest.raises(APIError, match="unable to freeze"):
        pause(job)
    assert job.worker.pauses == soak_faults.PAUSE_TRIES

    class Gone(Worker):
        def pause(self) -> None:
            self.pauses += 1
            raise APIError('404 Client Error: Not Found ("No such container: 4b1c")')

    other = Job(comes_back=True)
    other.worker = Gone(other.ps, comes_back=True)
    with pytest.raises(APIError, match="No such container"):
        pause(other)
    assert other.worker.pauses == 1  # not a freezer's failure: not tried again
