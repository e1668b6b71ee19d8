"""`ps.shards: K`: the topology field, the shard services in the render, `orchestrator local`'s plan."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import jsonschema
import pytest
import yaml

from orchestrator.render import compose as render_compose
from orchestrator.topology.model import Topology, TopologyError, load, parse
from orchestrator.topology.services import describe, service_names
from orchestrator.verbs import local

from orch_helpers import HERE, REPO, topology, training

GOLDEN = HERE / "golden" / "cpu-smoke-shards2.yaml"


def _smoke(shards: int) -> Topology:
    t = load(REPO / "configs/cpu-smoke.yaml")
    return t.model_copy(update={"ps": dataclasses.replace(t.ps, shards=shards)})


def test_golden_with_two_shards() -> None:
    t = _smoke(2)
    text = render_compose.dump(render_compose.render(t), t.name)
    if os.environ.get("UPDATE_GOLDEN") == "1":
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text(), f"render differs from {GOLDEN}; if intended: UPDATE_GOLDEN=1"


def test_shard_services_share_the_ps_image_env_and_volume() -> None:
    t = _smoke(3)
    doc = render_compose.render(t)
    assert list(training(doc)) == service_names(t) == ["ps", "ps-shard1", "ps-shard2", "worker1", "worker2"]
    ps = doc["services"]["ps"]
    for index in (1, 2):
        svc = doc["services"][f"ps-shard{index}"]
        assert svc["image"] == ps["image"] and "build" not in svc and svc["command"] == ["ps"]
        # The PS alone logs the run (and takes the credentials for it)
        own = {k: v for k, v in ps["environment"].items() if not k.startswith("MLFLOW_") and v is not None}
        assert svc["environment"] == {**own, "PSC_SHARD": str(index)}
        assert svc["depends_on"] == {"pidns": {"condition": "service_started"}, "ps": {"condition": "service_healthy"}}
        assert svc["pid"] == "service:pidns" and "cap_add" not in svc
        assert svc["restart"] == "on-failure" and svc["volumes"] == ps["volumes"]
        assert "deploy" not in svc and "healthcheck" not in svc and "ports" not in svc
    for name in ("ps", "worker1", "worker2"):
        assert doc["services"][name]["environment"]["PSC_SHARDS"] == "3"
        assert "PSC_SHARD" not in doc["services"][name]["environment"]
    assert describe(t) == "ps + 2 shards + 2 workers"


def test_one_shard_renders_as_before() -> None:
    t = load(REPO / "configs/cpu-smoke.yaml")
    assert t.ps.shards == 1
    assert render_compose.render(t) == render_compose.render(_smoke(1))
    assert all("PSC_SHARDS" not in s["environment"] for s in training(render_compose.render(t)).values())


def test_schema_accepts_shard_services() -> None:
    schema = json.loads((HERE / "compose-spec.json").read_text())
    doc = yaml.safe_load(render_compose.dump(render_compose.render(_smoke(2)), "cpu-smoke"))
    assert list(jsonschema.Draft7Validator(schema).iter_errors(doc)) == []


@pytest.mark.parametrize(
    "shards,problem",
    [
        (0, "ps.shards: got 0; must be greater than or equal to 1"),
        (9, "ps.shards: got 9; must be less than or equal to 8"),
        ("2", "ps.shards: got '2'; must be a valid integer"),
    ],
)
def test_bad_shards(shards, problem) -> None:
    with pytest.raises(TopologyError) as error:
        parse(yaml.safe_dump(topology(ps={"shards": shards})), "t.yaml")
    assert str(error.value) == f"t.yaml: {problem}"


def test_allreduce_with_shards_is_refused() -> None:
    with pytest.raises(TopologyError) as error:
        parse(yaml.safe_dump(topology(ps={"shards": 2}, train={"strategy": "allreduce"})), "t.yaml")
    assert str(error.value) == ("t.yaml: ps.shards: got 2; allowed only with a parameter server; allreduce has none")


def test_local_plan_starts_the_shards_as_ps_processes(tmp_path: Path) -> None:
    specs = local.plan(_smoke(2), port=29999, run_dir=tmp_path, ifname="lo", python="py")
    assert [s.name for s in specs] == ["ps", "ps-shard1", "worker1", "worker2"]
    shard = specs[1]
    assert shard.argv == ["py", "-m", "app", "ps"] and shard.env["PSC_SHARD"] == "1"
    assert shard.env["PSC_SHARDS"] == "2" and shard.env["PSC_RANK"] == "0"
    assert specs[2].env["PSC_SHARDS"] == "2" and "PSC_SHARD" not in specs[2].env
