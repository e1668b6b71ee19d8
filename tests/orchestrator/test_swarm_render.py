"""The swarm render (`render --target swarm`): whole-document golden files, the
Compose schema, `docker stack config`, and what Swarm needs differently."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Optional

import jsonschema
import pytest
import yaml

from orchestrator.render import compose as render_compose
from orchestrator.render import swarm as render_swarm
from orchestrator.render.yamlio import yaml_text
from orchestrator.topology.model import Topology, load, parse, size_bytes
from orchestrator.topology.services import service_names

from needs import unavailable
from orch_helpers import HERE, REPO

GOLDEN = HERE / "golden"
DATA_ROOT = "/srv/ps-compose"  # where a relative train.data_dir is taken from, in the goldens

# Seed 000's GPU run, placed: the PS on a named host with a GPU of its own, the
# workers by hostname and by node label, GPUs advertised as NVIDIA-GPU, the port published.
PLACED = (
    (REPO / "configs/default.yaml").read_text()
    + """
swarm:
  ps: ps-host
  workers: [gpu-a, gpu-a, zone=b]
  gpu_resource: NVIDIA-GPU
"""
)
PLACED = PLACED.replace("  # gpu: 0 ", "  gpu: 0 ").replace("publish_rpc_port: false", "publish_rpc_port: true")

# Two workers on two named nodes, no swarm.ps: the PS (its checkpoints) is pinned to the manager;
# the same with the state on NFS: not pinned, the volume is a share.
SPREAD = (
    (REPO / "configs/cpu-smoke.yaml").read_text()
    + """
swarm:
  workers: [node-a, node-b]
"""
)
SHARED = (
    SPREAD
    + """
state:
  volume_driver: local
  driver_opts: {type: nfs, o: "addr=10.0.0.5,rw,nfsvers=4", device: ":/exports/psc"}
"""
)

# (golden file, config or YAML text, --workers)
CASES = [
    ("swarm-spread.yaml", SPREAD, None),
    ("swarm-shared-state.yaml", SHARED, None),
    ("swarm-cpu-smoke.yaml", "configs/cpu-smoke.yaml", None),
    ("swarm-cpu-smoke-workers8.yaml", "configs/cpu-smoke.yaml", 8),
    ("swarm-default.yaml", "configs/default.yaml", None),
    ("swarm-placed.yaml", PLACED, None),
]
IDS = [c[0] for c in CASES]


def topo(config: str, workers: Optional[int] = None) -> Topology:
    t = parse(config, "placed.yaml") if "\n" in config else load(REPO / config)
    return t.with_workers(workers) if workers is not None else t


def rendered(config: str, workers: Optional[int] = None) -> str:
    t = topo(config, workers)
    return render_swarm.dump(render_swarm.render(t, data_root=DATA_ROOT), t.name)


@pytest.mark.parametrize("golden,config,workers", CASES, ids=IDS)
def test_golden(golden: str, config: str, workers: Optional[int]) -> None:
    text = rendered(config, workers)
    path = GOLDEN / golden
    if os.environ.get("UPDATE_GOLDEN") == "1":
        path.write_text(text)
    assert path.exists(), f"no {path}: run with UPDATE_GOLDEN=1 (tests/orchestrator/README.md)"
    assert text == path.read_text(), f"swarm render differs from {path}; if intended: UPDATE_GOLDEN=1"


@pytest.mark.parametrize("golden,config,workers", CASES, ids=IDS)
def test_schema(golden: str, config: str, workers: Optional[int]) -> None:
    schema = json.loads((HERE / "compose-spec.json").read_text())
    doc = yaml.safe_load(rendered(config, workers))
    errors = [
        f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
        for e in jsonschema.Draft7Validator(schema).iter_errors(doc)
    ]
    assert errors == []


def docker_stack_config() -> Optional[str]:
    """The docker CLI when it has `docker stack config` (CLI 25+), else None."""
    docker = shutil.which("docker")
    if docker is None:
        return None
    p = subprocess.run([docker, "stack", "config", "--help"], capture_output=True, text=True, timeout=30)
    return docker if p.returncode == 0 else None


def stack_config(text: str, tmp_path: Path) -> subprocess.CompletedProcess:
    docker = docker_stack_config()
    if docker is None:
        unavailable("this docker CLI has no `docker stack config` (CLI 25+); the schema test still runs")
    (tmp_path / "stack.yaml").write_text(text)
    return subprocess.run(
        [docker, "stack", "config", "-c", "stack.yaml"], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize("golden,config,workers", CASES, ids=IDS)
def test_docker_stack_config(tmp_path: Path, golden: str, config: str, workers: Optional[int]) -> None:
    p = stack_config(rendered(config, workers), tmp_path)
    assert p.returncode == 0, p.stderr
    # What docker stack reads back is what was written (nothing dropped on the way).
    back = yaml.safe_load(p.stdout)
    assert set(back["services"]) == set(yaml.safe_load(rendered(config, workers))["services"])


def test_docker_stack_config_rejects_the_compose_render(tmp_path: Path) -> None:
    # Why a second render: Swarm's schema has no reservations.devices (GPUs in compose).
    t = load(REPO / "configs/default.yaml")
    doc = render_compose.render(t)
    for svc in doc["services"].values():
        svc.pop("depends_on", None)  # the 3.x schema wants a list here; it is not the point
    p = stack_config("version: '3.8'\n" + yaml_text(doc), tmp_path)
    assert p.returncode != 0 and "devices" in p.stderr, p.stderr


# --- what differs from the compose render ----------------------------------


def services(config: str = "configs/cpu-smoke.yaml", workers: Optional[int] = None) -> dict:
    return yaml.safe_load(rendered(config, workers))["services"]


def test_no_key_swarm_ignores_or_rejects() -> None:
    for name, svc in services("configs/default.yaml").items():
        for key in ("build", "depends_on", "restart", "shm_size", "security_opt", "healthcheck"):
            assert key not in svc, (name, key)
        assert "devices" not in svc["deploy"].get("resources", {}).get("reservations", {}), name


def test_every_service_is_dnsrr_one_replica_and_one_shot() -> None:
    svcs = services()
    for name, svc in svcs.items():
        d = svc["deploy"]
        assert (d["mode"], d["replicas"], d["endpoint_mode"]) == ("replicated", 1, "dnsrr"), name
    # Never restarted after success (Swarm's default would): compose's `restart: on-failure`
    # becomes a few delayed attempts, no `restart` becomes none.
    compose = render_compose.render(load(REPO / "configs/cpu-smoke.yaml"))["services"]
    for name, svc in svcs.items():
        policy = svc["deploy"]["restart_policy"]
        if compose[name].get("restart") == "on-failure":
            assert policy["condition"] == "on-failure" and 1 <= policy["max_attempts"] <= 5 and policy["delay"], name
        else:
            assert policy == {"condition": "none"}, name
    assert svcs["worker1"]["deploy"]["restart_policy"]["condition"] == "on-failure"


def test_shm_size_becomes_a_tmpfs_at_dev_shm() -> None:
    t = load(REPO / "configs/default.yaml")
    svcs = services("configs/default.yaml")
    for name, size in (("ps", t.ps.shm_size), ("worker1", t.workers.shm_size)):
        tmpfs = [v for v in svcs[name]["volumes"] if v["type"] == "tmpfs"]
        assert tmpfs == [{"type": "tmpfs", "target": "/dev/shm", "tmpfs": {"size": size_bytes(size)}}]
    assert size_bytes("2g") == 2 * 1024**3 and size_bytes("256m") == 256 * 1024**2
    assert size_bytes("1.5gb") == 3 * 1024**3 // 2 and size_bytes(1000) == 1000


def test_gpus_are_generic_resources_one_per_gpu_service() -> None:
    svcs = services(PLACED)
    want = [{"discrete_resource_spec": {"kind": "NVIDIA-GPU", "value": 1}}]
    for name in ("ps", "worker1", "worker2", "worker3"):
        assert svcs[name]["deploy"]["resources"]["reservations"]["generic_resources"] == want, name
    assert "resources" not in services("configs/default.yaml")["ps"]["deploy"]  # no ps.gpu: the PS on CPU
    assert all("resources" not in s["deploy"] for s in services().values())  # cpu


def test_placement_by_hostname_and_by_label() -> None:
    svcs = services(PLACED)
    got = {n: s["deploy"].get("placement", {}).get("constraints") for n, s in svcs.items()}
    assert got == {
        "ps": ["node.hostname==ps-host"],
        "worker1": ["node.hostname==gpu-a"],
        "worker2": ["node.hostname==gpu-a"],
        "worker3": ["node.labels.zone==b"],
    }
    one = parse((REPO / "configs/cpu-smoke.yaml").read_text() + "swarm: {workers: [gpu=true]}\n")
    assert render_swarm.render(one.with_workers(4), data_root="/x")["services"]["worker4"]["deploy"]["placement"] == {
        "constraints": ["node.labels.gpu==true"]
    }
    assert all("placement" not in s["deploy"] for s in services().values())


def test_a_published_port_is_host_mode_and_private_by_default() -> None:
    assert services(PLACED)["ps"]["ports"] == [{"target": 29500, "published": 29500, "protocol": "tcp", "mode": "host"}]
    assert all("ports" not in s for s in services().values())


def test_relative_data_dir_becomes_absolute() -> None:
    bind = [v for v in services("configs/default.yaml")["worker1"]["volumes"] if v["type"] == "bind"]
    assert bind == [
        {"type": "bind", "source": "/srv/ps-compose/data/imagenette2/val", "target": "/data", "read_only": True}
    ]


def test_overlay_network_and_the_same_app_environment() -> None:
    t = load(REPO / "configs/cpu-smoke.yaml")
    doc, compose = render_swarm.render(t, data_root="/x"), render_compose.render(t)
    assert doc["networks"]["cluster"]["driver"] == "overlay"
    for name in service_names(t):
        # the same, but for the exchange (a swarm container's /dev/shm is its own) and the run's
        # secret: a Docker secret, over TCP (CURVE) rather than UNIX sockets on one host
        want = compose["services"][name]["environment"] | render_compose.TRANSPORT_ONLY
        del want["PSC_SOCKET_DIR"]
        want["PSC_SECRET_FILE"] = render_swarm.SECRET_FILE
        assert doc["services"][name]["environment"] == want
        assert doc["services"][name]["user"] == "1000:1000" and doc["services"][name]["cap_drop"] == ["ALL"]


def test_placement_topology_errors() -> None:
    base = (REPO / "configs/cpu-smoke.yaml").read_text()
    with pytest.raises(
        Exception, match=r"swarm.workers: got \['a', 'b'\] for 3 workers; must list one node per worker"
    ):
        parse(base + "swarm: {workers: [a, b]}\n", "x.yaml").with_workers(3)
    with pytest.raises(Exception, match="swarm.ps: got 'a b'; must be a node hostname"):
        parse(base + "swarm: {ps: a b}\n", "x.yaml")
    with pytest.raises(Exception, match="swarm.gpu_resource: got '1x'"):
        parse(base + "swarm: {gpu_resource: 1x}\n", "x.yaml")


def test_cli_render_target_swarm(cli, tmp_path: Path) -> None:
    status, out, err = cli("render", "-c", str(REPO / "configs/cpu-smoke.yaml"), "--target", "swarm")
    assert status == 0, err
    assert out.startswith("wrote stack.yaml: ps + 2 workers") and "stack cpu-smoke" in out
    assert (tmp_path / "stack.yaml").read_text() == rendered("configs/cpu-smoke.yaml")
    status, out, _ = cli("render", "-c", str(REPO / "configs/cpu-smoke.yaml"), "--target", "swarm", "-o", "-")
    assert status == 0 and out == rendered("configs/cpu-smoke.yaml")
    status, _, err = cli("render", "--target", "nomad")
    assert status == 2 and "invalid choice" in err


def test_compose_render_is_unchanged_by_the_swarm_section() -> None:
    t = topo(PLACED)
    plain = t.model_copy(update={"swarm": type(t.swarm)()})
    assert render_compose.render(t) == render_compose.render(plain)
