"""The run-record store: which cluster each target's up started last (runs/<target's
record>), so down, logs, status, scale and tensorboard without -c act on it. One schema for
every target; a record an older version wrote (`project`/`compose_file`, `stack`/`stack_file`)
is read too."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from orchestrator import paths
from orchestrator.backends.base import Backend, Cluster
from orchestrator.render.yamlio import write_atomic


def path(backend: Backend, runs: Optional[Path] = None) -> Path:
    return (runs or paths.RUNS) / backend.record


def save(backend: Backend, c: Cluster, runs: Optional[Path] = None) -> None:
    rec: dict[str, Any] = {
        "target": backend.name,
        "name": c.name,
        "file": str(c.file),
        "config": c.config,
        "workers": c.workers,
        "strategy": c.strategy,
    }
    where = path(backend, runs)
    where.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(where, json.dumps(rec, indent=2) + "\n")


def load(backend: Backend, runs: Optional[Path] = None) -> Optional[Cluster]:
    """The cluster the last up of `backend` started (its topology not loaded: the file may
    have changed since); None when there is no record."""
    where = path(backend, runs)
    if not backend.record or not where.is_file():
        return None
    rec = json.loads(where.read_text(encoding="utf-8"))
    name = rec.get("name") or rec.get("project") or rec.get("stack")
    file = rec.get("file") or rec.get("compose_file") or rec.get("stack_file") or backend.path_of(name)
    return Cluster(name, Path(file), rec.get("config"), rec.get("workers"), rec.get("strategy"))
