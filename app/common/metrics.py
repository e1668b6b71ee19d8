"""JSON-lines metrics: one object a line with time, role, rank, event, step (design.md)."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from app.config import Config
from app.contract import RUN_ID_ENV, metrics_file


class MetricsWriter:
    """Appends events to `<metrics_dir>/<name>.jsonl`, flushed line by line."""

    def __init__(self, metrics_dir: str, name: str, role: str, rank: int) -> None:
        directory = Path(metrics_dir)
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / metrics_file(name)
        self.role, self.rank = role, rank
        self._file = open(self.path, "a", buffering=1, encoding="utf-8")
        self._lock = threading.Lock()  # the PS writes from RPC threads too

    def write(self, event: str, step: int, **fields: Any) -> None:
        record = {
            "time": round(time.time(), 3),
            "role": self.role,
            "rank": self.rank,
            "event": event,
            "step": step,
            **fields,
        }
        with self._lock:
            self._file.write(json.dumps(record) + "\n")

    def start(self, config: Config, step: int = 0) -> None:
        """The `start` record: what this process trains, as it starts (so a reader of the
        metrics need not guess the run's settings)."""
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
            run_id=config.run_id or os.environ.get(RUN_ID_ENV, ""),
        )

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read(path: str | Path) -> list[dict[str, Any]]:
    """Every record of one metrics file (for tests and tools)."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
