"""The run-record store: which cluster each target's up started last (runs/<target's
record>), so down, logs, status, scale and tensorboard without -c act on it; and, under
runs/<name>/, the last up of each name (`--name`/`NAME=` alone finds its config there). One
schema for every target; a record an older version wrote (`project`/`compose_file`,
`stack`/`stack_file`) is read too."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from orchestrator import paths
from orchestrator.backends.base import Backend, Cluster
from orchestrator.render.yamlio import write_atomic


def path(backend: Backend, runs: Optional[Path] = None, name: Optional[str] = None) -> Path:
    """The last up's record; with `name`, the last up of that name (runs/<name>/up.json,
    stack-up.json)."""
    if name is not None:
        return (runs or paths.RUNS) / name / f"{backend.verb_prefix or ''}up.json"
    return (runs or paths.RUNS) / backend.record


def save(backend: Backend, c: Cluster, runs: Optional[Path] = None) -> None:
    """Record `c` as the last up, and as the last up of its name."""
    rec: dict[str, Any] = {
        "target": backend.name,
        "name": c.name,
        "file": str(c.file),
        "config": c.config,
        "workers": c.workers,
        "strategy": c.strategy,
        "overrides": list(c.topology.overrides) if c.topology is not None else [],  # KEY=VALUE, as typed
        "files": [str(f) for f in c.files],  # compose's override files (`up -f`), absolute
    }
    for where in (path(backend, runs), path(backend, runs, c.name)):
        where.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(where, json.dumps(rec, indent=2) + "\n")


def load(backend: Backend, runs: Optional[Path] = None, name: Optional[str] = None) -> Optional[Cluster]:
    """The cluster the last up of `backend` started (with `name`: the last up of that name; its
    topology not loaded: the file may have changed since); None when there is no record."""
    where = path(backend, runs, name)
    if not backend.record or not where.is_file():
        return None
    rec = json.loads(where.read_text(encoding="utf-8"))
    name = rec.get("name") or rec.get("project") or rec.get("stack")
    file = rec.get("file") or rec.get("compose_file") or rec.get("stack_file") or backend.path_of(name)
    overrides = tuple(rec.get("overrides") or ())
    files = tuple(Path(f) for f in rec.get("files") or ())
    return Cluster(
        name, Path(file), rec.get("config"), rec.get("workers"), rec.get("strategy"), overrides=overrides, files=files
    )
