"""The app's metrics: one writer, its sinks. Every record (time, role, rank, event, step and
its fields; design.md) goes to the JSON lines the orchestrator reads, and its numbers to
TensorBoard's event files (app/training/event_files.py) once the process has started training;
the PS's also to MLflow where MLFLOW_TRACKING_URI is set (app/training/tracking.py)."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from app.config import Config
from app.contract import MLFLOW_PENDING_DIR, PS, RUN_ID_ENV, metrics_file
from app.option_table import OPTIONS
from app.training.event_files import EventFiles
from app.training.tracking import Tracker

log = logging.getLogger("app.metrics")


class JsonLines:
    """Appends records to `<metrics_dir>/<name>.jsonl`, each line whole or not at all.

    A line that does not fit (a full state volume, a file size limit) is dropped, not a
    failure of the process: the file is cut back to its last whole line, one warning
    says so, and one line more when records are written again (how many were lost)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.dropped = 0  # records not written since the last one that was

    def write(self, record: dict[str, Any]) -> bool:
        """Append `record`; whether it fit."""
        line = (json.dumps(record) + "\n").encode()
        size = os.fstat(self._fd).st_size
        try:
            view = memoryview(line)
            while view:
                view = view[os.write(self._fd, view) :]
        except OSError as error:
            os.ftruncate(self._fd, size)  # no partial line: the next record starts a line of its own
            if not self.dropped:
                log.warning("metrics: record not written to %s (%s); dropping records until it fits", self.path, error)
            self.dropped += 1
            return False
        if self.dropped:
            log.warning("metrics: writing to %s again; %d record(s) were dropped", self.path, self.dropped)
            self.dropped = 0
        return True

    def close(self) -> None:
        os.close(self._fd)


class MetricsWriter:
    """The one writer of a process's metrics: `write(event, step, **fields)` records it in
    `<metrics_dir>/<name>.jsonl` and, from `start` on, in the process's TensorBoard event files."""

    def __init__(self, metrics_dir: str, name: str, role: str, rank: int) -> None:
        directory = Path(metrics_dir)
        directory.mkdir(parents=True, exist_ok=True)
        self.metrics_dir, self.name = metrics_dir, name
        self.path = directory / metrics_file(name)
        self.role, self.rank = role, rank
        self._lines = JsonLines(self.path)
        self._events: EventFiles | None = None
        self.tracker: Tracker | None = None  # the PS's run in MLflow, from `start` on
        self._lock = threading.Lock()  # the PS writes from RPC threads too

    def write(self, event: str, step: int, **fields: Any) -> None:
        now = time.time()
        record = {
            "time": round(now, 3),
            "role": self.role,
            "rank": self.rank,
            "event": event,
            "step": step,
            **fields,
        }
        with self._lock:
            fit = self._lines.write(record)
            if self._events is not None:
                self._events.write(event, step, fields, now, room=fit)
            if self.tracker is not None:
                self.tracker.record(event, step, fields)

    def worker(self, name: str, step: int, loss: float, samples_per_s: float | None) -> None:
        """A worker's training loss and samples/s as its push carried them (the PS's version
        then: `step`), to MLflow only: the worker's own metrics and event files hold them."""
        tracker = self.tracker
        if tracker is not None:
            tracker.record("worker", step, {"worker": name, "loss": loss, "samples_per_s": samples_per_s})

    def start(self, config: Config, step: int = 0) -> None:
        """The `start` record: what this process trains, as it starts (so a reader of the
        metrics need not guess the run's settings). The event files open here, at `step`:
        a process that starts again continues its run's curves from where it resumed."""
        run_id = config.run_id or os.environ.get(RUN_ID_ENV, "")
        with self._lock:
            if self._events is None:
                self._events = EventFiles.open(self.metrics_dir, run_id, self.name, step)
            if self.tracker is None and self.name == PS:
                keep = Path(self.metrics_dir, MLFLOW_PENDING_DIR, run_id) if run_id else None
                self.tracker = Tracker.from_env(os.environ, run_id, keep)
        self.write(
            "start",
            step,
            name=config.name,
            strategy=config.strategy,
            batch_size=config.batch_size,
            world_size=config.world_size,
            workers=config.num_trainers,
            shards=config.shards,
            model=config.model,
            dataset=config.dataset,
            precision=config.precision,
            compress=config.compress,
            run_id=run_id,
        )
        if self.tracker is not None:
            self.tracker.params(training_parameters(config))

    def close(self, status: str = "FAILED") -> None:
        """`status`: how the run ends in MLflow unless its `end` record ended it FINISHED."""
        with self._lock:
            self._lines.close()
            if self._events is not None:
                self._events.close()
                self._events = None
            tracker, self.tracker = self.tracker, None
        if tracker is not None:
            tracker.close(status)

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        self.close("KILLED" if kind is not None and issubclass(kind, (SystemExit, KeyboardInterrupt)) else "FAILED")


def training_parameters(config: Config) -> dict[str, Any]:
    """The run's parameters as the topology names them (train.*, and how many workers and PS
    processes), for the tracker."""
    values: dict[str, Any] = {o.topology: getattr(config, o.name) for o in OPTIONS if o.topology.startswith("train.")}
    return {**values, "workers.count": config.num_trainers, "ps.shards": config.shards}


class Rates:
    """Updates and samples per second since the previous call (for the `eval` records)."""

    def __init__(self, step: int, samples: int) -> None:
        self._mark = (time.monotonic(), step, samples)

    def since(self, step: int, samples: int) -> dict[str, float]:
        now = time.monotonic()
        then, step_then, samples_then = self._mark
        self._mark = (now, step, samples)
        seconds = max(now - then, 1e-9)
        return {
            "updates_per_s": round((step - step_then) / seconds, 2),
            "samples_per_s": round((samples - samples_then) / seconds, 1),
        }


def read(path: str | Path) -> list[dict[str, Any]]:
    """Every record of one metrics file (for tests and tools)."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def run_records(metrics_dir: str | Path, name: str, run_id: str) -> list[dict[str, Any]]:
    """The records process `name` wrote in run `run_id`: from each `start` record that carries
    that run id to the next `start` of another run. [] without a run id (runs cannot be told
    apart), or when there is no such file; a line that is not whole JSON is skipped."""
    path = Path(metrics_dir) / metrics_file(name)
    if not run_id or not path.is_file():
        return []
    found, inside = [], False
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if not isinstance(record, dict):
                continue
            if record.get("event") == "start":
                inside = record.get("run_id") == run_id
            if inside:
                found.append(record)
    return found
