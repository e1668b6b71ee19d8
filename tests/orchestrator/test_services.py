"""orchestrator.services: the one list of services a topology has, and its users
(local, check, chaos, swarm, cluster) that no longer parse service names."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from orchestrator.backends import inspect as compose_inspect
from orchestrator.backends.target_run import TargetRun
from orchestrator.render import compose as render_compose
from orchestrator.topology import services as spec_services
from orchestrator.topology.model import load
from orchestrator.topology.services import LABEL_RANK, LABEL_ROLE, Service, service_names
from orchestrator.verbs.check import check_document, plan_local
from orchestrator.verbs.local import plan

from orch_helpers import REPO, topology, training

SMOKE = REPO / "configs/cpu-smoke.yaml"


def _shards(k: int):
    base = load(SMOKE)
    return base.model_copy(update={"ps": dataclasses.replace(base.ps, shards=k)})


def test_services_of_a_sharded_ps() -> None:
    assert spec_services.services(_shards(3)) == [
        Service("ps", "ps", 0, 0, None, "ps.jsonl"),
        Service("ps-shard1", "ps", 0, 1, None, "ps1.jsonl"),
        Service("ps-shard2", "ps", 0, 2, None, "ps2.jsonl"),
        Service("worker1", "worker", 1, 0, None, "worker1.jsonl"),
        Service("worker2", "worker", 2, 0, None, "worker2.jsonl"),
    ]
    assert [s.rpc_name for s in spec_services.services(_shards(2))] == ["ps", "ps1", "worker1", "worker2"]


def test_services_follow_the_render(write_config) -> None:
    # Names and order are the render's; role and rank are its labels; GPU its device reservation.
    for doc in (
        topology(),
        topology(train={"strategy": "allreduce"}),
        topology(ps={"shards": 2}),
        topology(image={"base": "b", "device": "cuda"}, workers={"count": 3, "gpus": [2, 0, 5]}, ps={"gpu": 1}),
    ):
        t = load(write_config(doc))
        rendered = training(render_compose.render(t))
        assert [s.name for s in spec_services.services(t)] == service_names(t) == list(rendered)
        for s in spec_services.services(t):
            svc = rendered[s.name]
            assert (s.role, str(s.rank)) == (svc["labels"][LABEL_ROLE], svc["labels"][LABEL_RANK])
            assert str(s.rank) == svc["environment"]["PSC_RANK"]
            assert str(s.shard) == svc["environment"].get("PSC_SHARD", "0")
            devices = svc.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
            assert s.gpu == (int(devices[0]["device_ids"][0]) if devices else None)
        assert compose_inspect.from_compose(
            yaml.safe_load(render_compose.dump(render_compose.render(t), t.name))
        ) == spec_services.services(t)


def test_gpus_in_rank_order(write_config) -> None:
    t = load(write_config(topology(image={"base": "b", "device": "cuda"}, workers={"count": 3, "gpus": [2, 0, 5]})))
    assert [(s.name, s.gpu) for s in spec_services.services(t)] == [
        ("ps", None),
        ("worker1", 2),
        ("worker2", 0),
        ("worker3", 5),
    ]


def test_order_puts_the_topology_first_then_natural_order() -> None:
    t = load(SMOKE)
    assert spec_services.order(["worker10", "worker2", "ps-shard1", "worker1", "ps"]) == [
        "ps",
        "ps-shard1",
        "worker1",
        "worker2",
        "worker10",
    ]
    assert spec_services.order(["worker3", "worker1", "ps", "worker2"], t) == ["ps", "worker1", "worker2", "worker3"]


def test_local_plan_of_a_sharded_ps(tmp_path: Path) -> None:
    specs = plan(_shards(2), port=1, run_dir=tmp_path, ifname="lo", python="/py")
    assert [(p.name, p.argv[-1], p.env["PSC_RANK"], p.env.get("PSC_SHARD")) for p in specs] == [
        ("ps", "ps", "0", None),
        ("ps-shard1", "ps", "0", "1"),
        ("worker1", "worker", "1", None),
        ("worker2", "worker", "2", None),
    ]


def test_check_local_plan_of_a_sharded_ps(tmp_path: Path) -> None:
    # Used to fail: ValueError: invalid literal for int() with base 10: 'ps-shard1'.
    ranks = plan_local(_shards(2), port=1, run_dir=tmp_path, python="/py")
    assert [(p.name, p.rank, p.env["PSC_RANK"], p.env.get("PSC_SHARD")) for p in ranks] == [
        ("ps", 0, "0", "0"),
        ("ps-shard1", 1, "1", "0"),
        ("worker1", 2, "2", "0"),
        ("worker2", 3, "3", "0"),
    ]
    # The same in containers: the shard's own PSC_SHARD would make the app refuse `check --rank 1`.
    env = check_document(_shards(2))["services"]["ps-shard1"]["environment"]
    assert (env["PSC_RANK"], env["PSC_SHARD"]) == ("1", "0")


def test_a_local_run_starts_a_shard_as_a_ps_and_its_records_are_the_shards(tmp_path: Path) -> None:
    specs = {s.name: s for s in plan(_shards(2), port=1, run_dir=tmp_path, ifname="lo")}
    shard = specs["ps-shard1"]
    assert shard.argv[-1] == "ps" and (shard.env["PSC_RANK"], shard.env.get("PSC_SHARD")) == ("0", "1")
    assert shard.anchor and not specs["worker2"].anchor
    job = TargetRun.local(_shards(2), tmp_path)
    (job.run_dir / "metrics").mkdir()
    (job.run_dir / "metrics" / "ps1.jsonl").write_text('{"event": "shard", "time": 5}\n')
    assert job.events("ps-shard1", "shard") == [{"event": "shard", "time": 5}]


@pytest.mark.slow
def test_check_local_with_two_shards_passes(tmp_path: Path) -> None:
    cfg = tmp_path / "shards.yaml"
    doc = yaml.safe_load(SMOKE.read_text())
    doc.setdefault("ps", {})["shards"] = 2
    cfg.write_text(yaml.safe_dump(doc))
    out = subprocess.run(
        [sys.executable, "-m", "orchestrator", "check", "-c", str(cfg), "--local", "--timeout", "30"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "ValueError" not in out.stderr
    assert "check passed: 4 ranks" in out.stdout
