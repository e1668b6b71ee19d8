"""The app's metrics: one writer, two sinks. Every record (time, role, rank, event, step and
its fields; design.md) goes to the JSON lines the orchestrator reads, and its numbers to
TensorBoard's event files (app/common/event_files.py) once the process has started training."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from app.common.event_files import EventFiles
from app.config import Config
from app.contract import RUN_ID_ENV, metrics_file


class JsonLines:
    """Appends records to `<metrics_dir>/<name>.jsonl`, flushed line by line."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = open(path, "a", buffering=1, encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self._file.close()


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
            self._lines.write(record)
            if self._events is not None:
                self._events.write(event, step, fields, now)

    def start(self, config: Config, step: int = 0) -> None:
        """The `start` record: what this process trains, as it starts (so a reader of the
        metrics need not guess the run's settings). The event files open here, at `step`:
        a process that starts again continues its run's curves from where it resumed."""
        run_id = config.run_id or os.environ.get(RUN_ID_ENV, "")
        with self._lock:
            if self._events is None:
                self._events = EventFiles.open(self.metrics_dir, run_id, self.name, step)
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

    def close(self) -> None:
        with self._lock:
            self._lines.close()
            if self._events is not None:
                self._events.close()
                self._events = None

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
