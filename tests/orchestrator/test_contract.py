"""The values the orchestrator and the app must agree on (orchestrator/topology/contract.py)
are the app's own: strategies, compressions, precisions, datasets, roles, RPC names.

The orchestrator keeps torch-free copies; this test imports the app's side (a test may)."""

from __future__ import annotations

import dataclasses
import importlib
from types import ModuleType

import pytest

from orchestrator.topology import contract
from orchestrator.topology.model import Train, load
from orchestrator.topology.services import metrics_file, services

from orch_helpers import REPO


def app_module(*names: str) -> ModuleType:
    """The first of `names` that imports (the app's layout may move a module into a package)."""
    for name in names:
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError:
            continue
    raise AssertionError(f"none of {names} imports")


@pytest.fixture(scope="module")
def app_config() -> ModuleType:
    return app_module("app.contract", "app.config")


def test_choices_are_the_apps(app_config: ModuleType) -> None:
    assert contract.STRATEGIES == tuple(app_config.STRATEGIES)
    assert contract.COMPRESSIONS == tuple(app_config.COMPRESSIONS)
    assert contract.PRECISIONS == tuple(app_config.PRECISIONS)
    assert contract.DATASETS == tuple(app_config.DATASETS)
    assert contract.IMAGE_CACHES == tuple(app_config.IMAGE_CACHES)
    assert contract.CHECK_RECORD == app_config.CHECK_RECORD
    assert contract.TRAINING_ROLES == app_config.TRAINING_ROLES and set(app_config.TRAINING_ROLES) <= set(
        app_config.ROLES
    )


def test_file_datasets_are_the_apps() -> None:
    data = app_module("app.common.data")
    assert contract.FILE_DATASETS == frozenset(data.FILE_DATASETS)


def test_the_topology_accepts_exactly_these() -> None:
    for field, values in (
        ("strategy", contract.STRATEGIES),
        ("compress", contract.COMPRESSIONS),
        ("precision", contract.PRECISIONS),
        ("image_cache", contract.IMAGE_CACHES),
    ):
        assert Train.model_fields[field].annotation.__args__ == values


def test_rpc_names_are_the_apps() -> None:
    config = app_module("app.config")
    base = config.Config(role="ps")
    t = load(REPO / "configs/cpu-smoke.yaml").with_workers(3)
    t = t.model_copy(update={"ps": t.ps.model_copy(update={"shards": 3})})
    for s in services(t):
        app_name = dataclasses.replace(base, role=s.role, rank=s.rank, shard=s.shard).name
        assert f"{app_name}.jsonl" == s.metrics_file == metrics_file(s.role, s.rank, s.shard)
        assert contract.rpc_name(s.role, s.rank, s.shard) == app_name
