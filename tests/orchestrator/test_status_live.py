"""`make status`'s live line: the workers the PS counts as joined whose container runs now,
named as in the table (`worker2`, never the RPC name `worker2_r2` of its second process); its
progress line: step of total, percent, samples/s and ETA at the PS's last evaluation.
Read through the real status verb from recorded containers (tests/orchestrator/recorded_engine.py)."""

from __future__ import annotations

import copy
import io
import json
import re
import time

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
        json.dumps(EVAL | {"time": time.time() - 9}),
    ]


EVAL = {"role": "ps", "rank": 0, "event": "eval", "step": 600, "accuracy": 0.9, "loss": 0.3}
EVAL |= {"updates_per_s": 13.5, "samples_per_s": 812.4, "total": 4680, "percent": 12.8, "eta_s": 302.2}


def status_of(monkeypatch: pytest.MonkeyPatch, containers: list[dict]) -> str:
    from orchestrator.backends.registry import get
    from orchestrator.verbs import cluster as verbs

    monkeypatch.setattr(images, "client", lambda timeout=600: RecordedEngine(containers, {"ps.jsonl": ps_records()}))
    out = io.StringIO()
    assert verbs.status(get("compose"), SMOKE, 3, name="cpu-smoke", out=out) == 0
    return out.getvalue()


def test_the_live_line_names_the_running_workers_as_the_table_does(monkeypatch: pytest.MonkeyPatch) -> None:
    # recorded: ps running, worker1 exited 0, worker2 restarting, worker3 running
    out = status_of(monkeypatch, recorded("status-workers3.json"))
    assert out.splitlines()[-2] == "live workers: 1 (worker3), last change at version 520"


def test_after_the_run_no_worker_is_live(monkeypatch: pytest.MonkeyPatch) -> None:
    ended = copy.deepcopy(recorded("status-workers3.json"))
    for attrs in ended:
        attrs["State"].update(Status="exited", Running=False, Restarting=False, ExitCode=0)
    out = status_of(monkeypatch, ended)
    assert "worker2_r2" not in out
    assert out.splitlines()[-2] == "live workers: 0 (none), last change at version 520"


def test_once_the_run_ended_the_live_line_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    from orchestrator.backends.status import format_live, live_workers

    lines = ps_records() + [json.dumps({"time": 1, "role": "ps", "rank": 0, "event": "end", "step": 640})]
    assert format_live(live_workers(lines)) == "live workers: 0 (the run ended at version 640)"
    again = lines + [json.dumps({"time": 2, "role": "ps", "rank": 0, "event": "start", "step": 640})]
    assert format_live(live_workers(again)) == "live workers: - (no worker joined yet)"  # resumed: a new run


def test_the_progress_line_is_the_ps_last_evaluations(monkeypatch: pytest.MonkeyPatch) -> None:
    out = status_of(monkeypatch, recorded("status-workers3.json"))
    assert re.fullmatch(
        r"progress: step 600 of 4680 \(12\.8%\), 812 samples/s, ETA 0:05:02 "
        r"\(at the PS's last evaluation, \d+ s ago\)",
        out.splitlines()[-1],
    ), out


def test_the_progress_line_says_what_is_known_and_when() -> None:
    from orchestrator.backends.status import format_progress, latest_progress

    now = 1000.0
    record = EVAL | {"time": now - 9}
    assert format_progress(record, now) == (
        "progress: step 600 of 4680 (12.8%), 812 samples/s, ETA 0:05:02 (at the PS's last evaluation, 9 s ago)"
    )
    unknown = {k: v for k, v in record.items() if k not in ("total", "percent", "eta_s")}
    assert format_progress(unknown, now) == (
        "progress: step 600 (total unknown), 812 samples/s (at the PS's last evaluation, 9 s ago)"
    )
    stalled = {k: v for k, v in record.items() if k != "eta_s"}  # no update since the evaluation before
    assert "ETA unknown (at the PS's" in format_progress(stalled, now)
    assert format_progress(None, now) == "progress: - (no evaluation yet)"
    lines = [json.dumps(record), json.dumps({"time": now, "role": "ps", "rank": 0, "event": "end", "step": 4680})]
    assert format_progress(latest_progress(lines), now) == "progress: ended at step 4680"
    restarted = [json.dumps(record), json.dumps({"time": now, "role": "ps", "rank": 0, "event": "start", "step": 600})]
    assert latest_progress(restarted) is None  # a restarted PS: its new run has not evaluated yet


def test_the_status_line_and_the_ps_eval_line_say_the_same() -> None:
    from app.training.progress import RunProgress
    from orchestrator.backends.status import format_progress

    where = RunProgress(done=1200, total=4680, updates_per_s=13.5, samples_per_s=812.4)
    record = {"time": 0.0, "event": "eval", "step": 1200, "samples_per_s": 812.4, **where.fields()}
    assert format_progress(record, 0.0) == f"progress: {where.line()} (at the PS's last evaluation, 0 s ago)"
    unknown = RunProgress(done=1200, total=None, updates_per_s=13.5, samples_per_s=812.4)
    record = {"time": 0.0, "event": "eval", "step": 1200, "samples_per_s": 812.4, **unknown.fields()}
    assert format_progress(record, 0.0) == f"progress: {unknown.line()} (at the PS's last evaluation, 0 s ago)"


def test_status_json_is_one_document_with_the_tables_rows_and_lines(monkeypatch: pytest.MonkeyPatch) -> None:
    from orchestrator.backends.registry import get
    from orchestrator.verbs import cluster as verbs

    monkeypatch.setattr(
        images,
        "client",
        lambda timeout=600: RecordedEngine(recorded("status-workers3.json"), {"ps.jsonl": ps_records()}),
    )
    out = io.StringIO()
    assert verbs.status(get("compose"), SMOKE, 3, name="cpu-smoke", as_json=True, out=out) == 0
    doc = json.loads(out.getvalue())  # the whole output parses: nothing but the document
    assert set(doc) == {"target", "name", "file", "services", "live", "progress"}
    assert (doc["target"], doc["name"]) == ("compose", "cpu-smoke")
    by_service = {r["service"]: r for r in doc["services"]}
    assert list(by_service) == ["ps", "worker1", "worker2", "worker3"]
    for row in doc["services"]:
        assert set(row) == {"service", "status", "exit_code", "health", "restarts", "step", "loss", "metric", "value"}
    assert by_service["worker2"]["status"] == "restarting"
    assert doc["live"] == {"workers": ["worker3"], "version": 520, "ended": False}
    assert doc["progress"]["step"] == 600 and doc["progress"]["total"] == 4680


def test_status_json_of_a_cluster_with_nothing_found_keeps_its_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    from orchestrator.backends.registry import get
    from orchestrator.verbs import cluster as verbs

    monkeypatch.setattr(images, "client", lambda timeout=600: RecordedEngine([], {}))
    out = io.StringIO()
    assert verbs.status(get("compose"), SMOKE, 2, name="cpu-smoke", as_json=True, out=out) == 0
    doc = json.loads(out.getvalue())
    assert [r["status"] for r in doc["services"]] == ["no container"] * 3
    assert doc["live"] is None and doc["progress"] is None
