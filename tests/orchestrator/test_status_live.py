"""`make status`'s live line: the workers the PS counts as joined whose container runs now,
named as in the table (`worker2`, never the RPC name `worker2_r2` of its second process).
Read through the real status verb from recorded containers (tests/orchestrator/recorded_engine.py)."""

from __future__ import annotations

import copy
import io
import json

import pytest
from recorded_engine import RecordedEngine, recorded

from orchestrator import images

from orch_helpers import REPO

SMOKE = str(REPO / "configs/cpu-smoke.yaml")


def ps_records() -> list[str]:
    def rec(event: str, step: int, rank: int, workers: int, name: str = "") -> str:
        return json.dumps(
            {"time": step, "role": "ps", "rank": 0, "event": event, "step": step}
            | {"worker": name or f"worker{rank}", "worker_rank": rank, "workers": workers}
        )

    return [
        json.dumps({"time": 0, "role": "ps", "rank": 0, "event": "start", "step": 0}),
        rec("join", 0, 1, 1),
        rec("join", 3, 2, 2),
        rec("join", 5, 3, 3),
        rec("drop", 500, 2, 2),
        rec("join", 520, 2, 3, "worker2_r2"),
    ]


def status_of(monkeypatch: pytest.MonkeyPatch, containers: list[dict]) -> str:
    from orchestrator.backends import verbs
    from orchestrator.backends.registry import get

    monkeypatch.setattr(images, "client", lambda timeout=600: RecordedEngine(containers, {"ps.jsonl": ps_records()}))
    out = io.StringIO()
    assert verbs.status(get("compose"), SMOKE, 3, name="cpu-smoke", out=out) == 0
    return out.getvalue()


def test_the_live_line_names_the_running_workers_as_the_table_does(monkeypatch: pytest.MonkeyPatch) -> None:
    # recorded: ps running, worker1 exited 0, worker2 restarting, worker3 running
    out = status_of(monkeypatch, recorded("status-workers3.json"))
    assert out.splitlines()[-1] == "live workers: 1 (worker3), last change at version 520"


def test_after_the_run_no_worker_is_live(monkeypatch: pytest.MonkeyPatch) -> None:
    ended = copy.deepcopy(recorded("status-workers3.json"))
    for attrs in ended:
        attrs["State"].update(Status="exited", Running=False, Restarting=False, ExitCode=0)
    out = status_of(monkeypatch, ended)
    assert "worker2_r2" not in out
    assert out.splitlines()[-1] == "live workers: 0 (none), last change at version 520"
