"""What MLflow had not taken when a run ended, kept on disk for a later sync: the PS writes it
(app.training.tracking, at its end), `ps-compose runs sync` sends it once the server answers
(orchestrator/verbs/mlflow_sync.py), and the MLflow run then ends as the run did, with every
point and the model.

A directory per run, `<metrics dir>/mlflow-pending/<run id>/`:

    run.json        {"experiment", "run_name", "server": the URI as the PS reached it, no password}
    records.jsonl   the tracker's items in order, one JSON object a line:
                    {"kind": "start" | "eval" | "end" | "worker", "step": n, "fields": {...}}
                    {"kind": "params", "params": {name: value}}
                    {"kind": "model", "path": "model", "files": [relative paths]}
                    {"kind": "close", "status": "FINISHED" | "FAILED" | "KILLED"}
    files/<path>/   a model item's files

A PS that restarts, resumes and ends with more of the same run kept adds its items after the
earlier ones. The directory is replaced whole (written beside it, then renamed)."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

RUN, RECORDS, FILES = "run.json", "records.jsonl", "files"


def save(directory: Path, experiment: str, run_name: str, server: str, items: Sequence[tuple[str, Any]]) -> None:
    """Keep `items` (the tracker's, in order) for the run in `directory`, after what an earlier
    end of the same run kept there."""
    fresh = directory.with_name(directory.name + ".new")
    shutil.rmtree(fresh, ignore_errors=True)
    (fresh / FILES).mkdir(parents=True)
    lines = _earlier(directory, fresh)
    for kind, value in items:
        if kind == "model":
            path, files = value
            for name, data in files.items():
                target = fresh / FILES / path / name
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(data)
            lines.append({"kind": kind, "path": path, "files": sorted(files)})
        elif kind == "params":
            lines.append({"kind": kind, "params": {k: str(v) for k, v in value.items()}})
        elif kind == "close":
            lines.append({"kind": kind, "status": value})
        else:
            step, fields = value
            lines.append({"kind": kind, "step": step, "fields": fields})
    about = {"experiment": experiment, "run_name": run_name, "server": server}
    (fresh / RUN).write_text(json.dumps(about) + "\n")
    (fresh / RECORDS).write_text("".join(json.dumps(line, default=str) + "\n" for line in lines))
    shutil.rmtree(directory, ignore_errors=True)
    os.replace(fresh, directory)


def _earlier(directory: Path, fresh: Path) -> list[dict[str, Any]]:
    """What an earlier end of this run kept (its files copied into `fresh`), else []."""
    if not (directory / RECORDS).is_file():
        return []
    if (directory / FILES).is_dir():
        shutil.copytree(directory / FILES, fresh / FILES, dirs_exist_ok=True)
    return [json.loads(line) for line in (directory / RECORDS).read_text().splitlines() if line.strip()]


def load(directory: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(run.json, the records in order) of a kept run; ValueError where they do not parse."""
    about = json.loads((directory / RUN).read_text())
    records = [json.loads(line) for line in (directory / RECORDS).read_text().splitlines() if line.strip()]
    if not isinstance(about, dict) or not all(isinstance(r, dict) and "kind" in r for r in records):
        raise ValueError(f"{directory}: not a kept MLflow run")
    return about, records
