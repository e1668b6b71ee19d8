"""The one reader of the app's JSON-lines metrics (app/training/metrics.py).

A record is one JSON object a line with at least `time` (unix seconds),
`role`, `rank`, `event` and `step`. A bad or partial line (a crash mid-write)
is skipped, never an error: readers see the records that were whole. Events are
`app.contract.Event` members: the readers take them, never a bare string, so the
type checker holds every reader to the events the app declares.
"""

from __future__ import annotations

import io
import json
import tarfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Optional

from app.contract import Event

Record = dict[str, Any]


def parse_line(line: str) -> Optional[Record]:
    """One record, or None for a line that is not a whole JSON object with a numeric `time`."""
    try:
        rec = json.loads(line)
    except ValueError:
        return None
    if isinstance(rec, dict) and isinstance(rec.get("time"), (int, float)) and not isinstance(rec["time"], bool):
        return rec
    return None


def parse_lines(lines: Iterable[str]) -> list[Record]:
    """The whole records among `lines`, in order."""
    return [rec for rec in map(parse_line, lines) if rec is not None]


def read_jsonl(path: Path) -> list[Record]:
    """The records of one metrics file ([] when it does not exist)."""
    if not path.is_file():
        return []
    return parse_lines(path.read_text(encoding="utf-8", errors="replace").splitlines())


def is_event(rec: Record, *wanted: Event) -> bool:
    """The record is of one of the events `wanted`."""
    return rec.get("event") in wanted


def events(records: Iterable[Record], event: Event, since: float = 0.0) -> list[Record]:
    """The records of this event written at or after `since` (unix time)."""
    return [r for r in records if is_event(r, event) and r["time"] >= since]


def headline(record: Record) -> str:
    """The name of an `eval` or `end` record's headline metric (its `metrics`' first; accuracy
    for a record without them)."""
    names = record.get("metrics")
    return str(names[0]) if isinstance(names, list) and names else "accuracy"


def final_accuracy(records: Iterable[Record]) -> Optional[float]:
    """The held-out accuracy of a run's last `end` record (the PS's, or allreduce's rank 0);
    None when it wrote none (the run did not get that far)."""
    ends = [r for r in records if is_event(r, Event.END) and isinstance(r.get("accuracy"), (int, float))]
    return float(ends[-1]["accuracy"]) if ends else None


GAP_SECONDS = 1.0  # after a clean `end`, a record this much later belongs to a new run


def last_segment(records: list[Record], gap: float = GAP_SECONDS) -> tuple[list[Record], int]:
    """The records of the last run in a file several runs appended to, and how many earlier
    records were left out. A run starts after an `end` followed by a record more than `gap`
    seconds later, or at a `start` or a `join` at step 0 after training had started; a PS
    restarted within a run (its `start` at the version it resumes) stays in that run."""
    start = 0
    ended_at: Optional[float] = None
    trained = False
    for i, rec in enumerate(records):
        fresh = is_event(rec, Event.START, Event.JOIN) and rec.get("step") == 0 and trained
        if (ended_at is not None and rec["time"] > ended_at + gap) or fresh:
            start, ended_at, trained = i, None, False
        if is_event(rec, Event.END):
            ended_at = rec["time"]
        if (rec.get("step") or 0) > 0:
            trained = True
    return records[start:], start


def course(records: Iterable[Record]) -> str:
    """How a run got to its final accuracy, in one line for a failed judgement: each `eval`
    record's update and accuracy; the joins, drops, returns, refusals and resumes, with the
    update each came at; the `end` record's staleness (mean, max) and pushes per worker.
    '' when the records hold none of these. Only the file's last run counts (`last_segment`)."""
    records, _ = last_segment(list(records))
    evals = [f"{r.get('step')}: {r['accuracy']:.4f}" for r in events(records, Event.EVAL) if "accuracy" in r]
    parts = [f"accuracy by update {', '.join(evals)}"] if evals else []
    moves = [
        " ".join(str(x) for x in (r["event"], r.get("worker"), "at", r.get("step")) if x is not None)
        for r in records
        if is_event(r, Event.JOIN, Event.DROP, Event.BACK, Event.REFUSED, Event.RESUME)
    ]
    if moves:
        parts.append(", ".join(moves))
    ends = events(records, Event.END)
    if ends and "staleness_mean" in ends[-1]:
        parts.append(f"staleness mean {ends[-1]['staleness_mean']}, max {ends[-1].get('staleness_max')}")
    if ends and ends[-1].get("pushes"):
        parts.append("pushes " + ", ".join(f"{k} {v}" for k, v in ends[-1]["pushes"].items()))
    return "; ".join(parts)


def metrics_from_tar(data: bytes) -> dict[str, list[str]]:
    """{file name: lines} of the *.jsonl files at the top of the directory in a tar (what
    get_archive returns: `metrics/ps.jsonl`; not those of its subdirectories, mlflow-pending/)."""
    found: dict[str, list[str]] = {}
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        for m in tar.getmembers():
            if m.isfile() and m.name.endswith(".jsonl") and len(Path(m.name).parts) == 2:
                f = tar.extractfile(m)
                if f is not None:
                    found[Path(m.name).name] = f.read().decode("utf-8", "replace").splitlines()
    return found
