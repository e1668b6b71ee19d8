from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from orchestrator.cli import main
from orchestrator.render.compose import SERVING

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent

# A small valid CPU topology; tests change one thing in it.
BASE: dict[str, Any] = {
    "name": "t",
    "image": {"base": "ps-compose-base:bookworm", "device": "cpu"},
    "train": {"model": "cnn", "dataset": "digits", "batch_size": 32, "lr": 0.05, "epochs": 2},
    "workers": {"count": 2},
}


def training(doc: dict[str, Any]) -> dict[str, Any]:
    """A compose document's training services: all but those that serve the run (`make tensorboard`'s,
    the MLflow server of tracking.mlflow) and the `pidns` holder of the shared PID namespace
    (network.same_host_copy)."""
    from orchestrator.topology.services import PIDNS_SERVICE

    return {n: s for n, s in doc["services"].items() if n not in (*SERVING, PIDNS_SERVICE)}


def topology(**sections: Any) -> dict[str, Any]:
    """BASE with some sections replaced or merged ({"train": {"lr": 0}} merges)."""
    doc = copy.deepcopy(BASE)
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(doc.get(key), dict):
            doc[key].update(value)
        else:
            doc[key] = value
    return doc


@pytest.fixture
def write_config(tmp_path: Path) -> Callable[..., Path]:
    def write(doc: Any, name: str = "topo.yaml") -> Path:
        path = tmp_path / name
        path.write_text(doc if isinstance(doc, str) else yaml.safe_dump(doc, sort_keys=False))
        return path

    return write


@pytest.fixture
def cli(capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """Run `python -m orchestrator ARGS` in-process in tmp_path: (status, stdout, stderr)."""
    monkeypatch.chdir(tmp_path)

    def run(*args: str) -> tuple[int, str, str]:
        try:
            status = main(list(args))
        except SystemExit as e:  # argparse
            status = e.code
        out, err = capsys.readouterr()
        return status, out, err

    return run


@pytest.fixture(scope="module")
def schema_validator():
    """The Compose Specification's JSON schema (compose-spec.json), checked, as a validator."""
    import json

    import jsonschema

    schema = json.loads((HERE / "compose-spec.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)
