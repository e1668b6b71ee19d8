"""One contract: what the app and the orchestrator must agree on is declared once, in the app's
standard-library modules app/contract.py, app/options.py and app/option_rules.py, and the
orchestrator reads it from there (choices, names, patterns, the rules between options). This test
imports the rest of the app (a test may) to hold the app's own uses to the same declarations."""

from __future__ import annotations

import dataclasses
import importlib
from pathlib import Path
from typing import Any

import pytest

from app import contract
from app.config import UsageError, parse
from app.option_rules import RULES
from orchestrator.topology import option_sections
from orchestrator.topology.messages import section_fields
from orchestrator.topology.model import TopologyError, load
from orchestrator.topology.model import parse as parse_topology
from orchestrator.topology.option_sections import Train
from orchestrator.topology.services import metrics_file, services

from orch_helpers import REPO, topology


def test_no_copy_of_the_contract_is_left_in_the_orchestrator() -> None:
    assert not (REPO / "orchestrator" / "topology" / "contract.py").exists()  # the copies it held
    assert option_sections.ENTRY_POINT is contract.ENTRY_POINT
    data = importlib.import_module("app.data.datasets")
    assert contract.FILE_DATASETS == frozenset(data.FILE_DATASETS)


def test_the_topology_accepts_exactly_these() -> None:
    for field, values in (
        ("strategy", contract.STRATEGIES),
        ("compress", contract.COMPRESSIONS),
        ("precision", contract.PRECISIONS),
        ("image_cache", contract.IMAGE_CACHES),
    ):
        assert section_fields(Train)[field].annotation.__args__ == values


def test_rpc_names_are_the_apps() -> None:
    base = parse(["ps"], {})
    t = load(REPO / "configs/cpu-smoke.yaml").with_workers(3)
    t = t.model_copy(update={"ps": dataclasses.replace(t.ps, shards=3)})
    for s in services(t):
        app_name = dataclasses.replace(base, role=s.role, rank=s.rank, shard=s.shard).name
        assert f"{app_name}.jsonl" == s.metrics_file == metrics_file(s.role, s.rank, s.shard)
        assert s.rpc_name == app_name


# Each rule of app/option_rules.py RULES broken once as a topology and once as the app's flags.
BROKEN: dict[str, tuple[dict[str, Any], list[str]]] = {
    "overlap": (
        topology(train={"strategy": "sync", "overlap": True}),
        ["worker", "--strategy", "sync", "--overlap", "true"],
    ),
    "shards": (
        topology(train={"strategy": "allreduce"}, ps={"shards": 2}),
        ["ps", "--strategy", "allreduce", "--shards", "2"],
    ),
    "max_workers below": (
        topology(workers={"count": 3, "max": 2}),
        ["ps", "--world_size", "4", "--max_workers", "2"],
    ),
    "max_workers allreduce": (
        topology(train={"strategy": "allreduce"}, workers={"count": 2, "max": 3}),
        ["worker", "--strategy", "allreduce", "--world_size", "3", "--max_workers", "3"],
    ),
    "momentum": (
        topology(train={"momentum": 0.9, "optimizer": "adamw"}),
        ["worker", "--momentum", "0.9", "--optimizer", "adamw"],
    ),
    "weight_decay": (
        topology(train={"weight_decay": 0.1, "optimizer": {"name": "sgd", "weight_decay": 0.2}}),
        ["worker", "--weight_decay", "0.1", "--optimizer", '{"name": "sgd", "weight_decay": 0.2}'],
    ),
    "schedule of your own, allreduce": (
        topology(train={"schedule": "mylib.sched:build", "strategy": "allreduce"}),
        ["worker", "--schedule", "mylib.sched:build", "--strategy", "allreduce"],
    ),
    "schedule plateau": (
        topology(train={"schedule": "plateau"}, ps={"shards": 2}),
        ["ps", "--schedule", "plateau", "--shards", "2"],
    ),
    "optimizer adafactor": (
        topology(train={"optimizer": "adafactor"}, ps={"shards": 2}),
        ["ps", "--optimizer", "adafactor", "--shards", "2"],
    ),
    "precision": (
        topology(train={"precision": "fp16"}),
        ["worker", "--precision", "fp16"],
    ),
    "cuda_graphs fp16": (
        topology(train={"precision": "fp16", "cuda_graphs": True}, image={"device": "cuda"}),
        ["worker", "--precision", "fp16", "--cuda_graphs", "true", "--device", "cuda"],
    ),
    "dataset webdataset without eval_data": (
        topology(train={"dataset": "webdataset", "data_dir": "https://host/train-{0..3}.tar", "max_steps": 10}),
        ["worker", "--dataset", "webdataset", "--data_dir", "https://host/train-{0..3}.tar", "--max_steps", "10"],
    ),
    "max_steps webdataset": (
        topology(train={"dataset": "webdataset", "data_dir": "s3://b/t-{0..3}.tar", "eval_data": "s3://b/v.tar"}),
        ["worker", "--dataset", "webdataset", "--data_dir", "s3://b/t-{0..3}.tar", "--eval_data", "s3://b/v.tar"],
    ),
    "staleness_lr diloco": (
        topology(train={"strategy": "diloco", "staleness_lr": True}),
        ["worker", "--strategy", "diloco", "--staleness_lr", "true"],
    ),
    "schedule plateau diloco_async": (
        topology(train={"strategy": "diloco_async", "schedule": "plateau"}),
        ["worker", "--strategy", "diloco_async", "--schedule", "plateau"],
    ),
    "cuda_graphs diloco": (
        topology(train={"strategy": "diloco", "cuda_graphs": True}, image={"device": "cuda"}),
        ["worker", "--strategy", "diloco", "--cuda_graphs", "true", "--device", "cuda"],
    ),
    "cuda_graphs allreduce": (
        topology(train={"strategy": "allreduce", "cuda_graphs": True}),
        ["worker", "--strategy", "allreduce", "--cuda_graphs", "true"],
    ),
}


def test_every_rule_between_options_is_broken_here() -> None:
    assert len(BROKEN) == len(RULES)


@pytest.mark.parametrize("case", list(BROKEN))
def test_the_app_and_the_topology_refuse_a_broken_rule_in_the_same_words(case: str, tmp_path: Path) -> None:
    import yaml

    doc, argv = BROKEN[case]
    with pytest.raises(TopologyError) as topo:
        parse_topology(yaml.safe_dump(doc), "t.yaml")
    with pytest.raises(UsageError) as app:
        parse(argv, {})
    said_topology, said_app = str(topo.value).split("; ", 1), str(app.value).split("; ", 1)
    assert said_topology[1] == said_app[1], (said_topology, said_app)  # what is allowed
    option = case.split()[0]
    assert said_app[0].startswith(f"--{option}: got ") and "\n" not in str(app.value)
