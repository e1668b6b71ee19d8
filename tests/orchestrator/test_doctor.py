"""`doctor`: each check as a pure function of facts (pass and fail), then the
failing conditions made real where they can be: a missing data dir, a port in
use, no daemon at a bad DOCKER_HOST; and the CLI's exit status."""

from __future__ import annotations

import io
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.errors import UsageError
from orchestrator.topology.model import Topology, parse

import doctor_kit as d
from needs import unavailable
from orch_helpers import REPO

GIB = 1024**3
CPU = (REPO / "configs/cpu-smoke.yaml").read_text()
GPU = (REPO / "configs/default.yaml").read_text()
INFO = {
    "ServerVersion": "20.10.24",
    "Runtimes": {"runc": {}},
    "MemTotal": 16 * GIB,
    "DockerRootDir": "/var/lib/docker",
    "Swarm": {"LocalNodeState": "inactive"},
}
NODE = {
    "hostname": "gpu-a",
    "role": "manager",
    "availability": "active",
    "state": "ready",
    "labels": {"zone": "a"},
    "resources": {"gpu": 2},
}


def topo(text: str = CPU, extra: str = "") -> Topology:
    return parse(text + extra, "t.yaml")


def facts(**kw) -> d.Facts:
    """A host where everything is fine for the CPU topology; tests change one fact."""
    base = dict(
        info=dict(INFO),
        api_version="1.41",
        compose="docker compose (compose v2)",
        stack_cli="/usr/bin/docker",
        gpus=[0, 1, 2],
        disk_free=100 * GIB,
        image_present=True,
    )
    base.update(kw)
    return d.Facts(**base)


def only(check, t: Topology, f: d.Facts, target: str = "compose") -> d.Check:
    return check(t, target, f)


# --- one test per check: ok, then the problem with its fix ------------------


def test_daemon() -> None:
    assert only(d.check_daemon, topo(), facts()).ok
    c = only(d.check_daemon, topo(), facts(daemon_error="connection refused", docker_host="tcp://h:1"))
    assert c.ok is False and "tcp://h:1 (connection refused)" in c.text and "make engine" in c.fix
    c = only(d.check_daemon, topo(), facts(api_version="1.39"))
    assert c.ok is False and "too old" in c.text


def test_compose_and_docker_stack() -> None:
    assert only(d.check_client, topo(), facts()).ok
    c = only(d.check_client, topo(), facts(compose=None, compose_error="no Docker Compose found"))
    assert c.ok is False and "make engine" in c.fix
    assert only(d.check_client, topo(), facts(stack_cli="/usr/bin/docker"), "swarm").ok
    assert only(d.check_client, topo(), facts(stack_cli=None), "swarm").ok is False


def test_nvidia_runtime() -> None:
    assert only(d.check_nvidia, topo(), facts()).text.startswith("not needed")
    c = only(d.check_nvidia, topo(GPU), facts())
    assert c.ok is False and c.text.startswith(
        "image.device is cuda, but this Docker engine offers no GPU: no NVIDIA runtime"
    )
    assert "nvidia-ctk runtime configure" in c.fix
    with_nvidia = dict(INFO, Runtimes={"runc": {}, "nvidia": {}})
    assert only(d.check_nvidia, topo(GPU), facts(info=with_nvidia)).ok
    # Swarm services cannot pick a runtime: it must be the default one.
    c = only(d.check_nvidia, topo(GPU), facts(info=with_nvidia), "swarm")
    assert c.ok is False and '"default-runtime": "nvidia"' in c.fix
    assert only(d.check_nvidia, topo(GPU), facts(info=dict(with_nvidia, DefaultRuntime="nvidia")), "swarm").ok
    # A manager without GPUs of its own has nothing to check locally.
    assert only(d.check_nvidia, topo(GPU), facts(), "swarm").ok


def test_gpu_ids_from_nvidia_smi() -> None:
    assert only(d.check_gpus, topo(GPU), facts(gpus=[0, 1, 2])).ok
    c = only(d.check_gpus, topo(GPU), facts(gpus=[0, 1]))
    assert c.ok is False and "GPU id(s) [2] not on this host" in c.text
    c = only(d.check_gpus, topo(GPU), facts(gpus=None))
    assert c.ok is False and "no nvidia-smi" in c.text
    assert only(d.check_gpus, topo(), facts(gpus=None)).ok  # cpu


def test_gpu_generic_resources_on_swarm() -> None:
    nodes = [NODE, dict(NODE, hostname="gpu-b", resources={"gpu": 1})]
    assert only(d.check_gpus, topo(GPU), facts(nodes=nodes), "swarm").ok  # 3 workers, 3 advertised
    down = [NODE, dict(NODE, hostname="gpu-b", state="down", resources={"gpu": 1})]
    c = only(d.check_gpus, topo(GPU), facts(nodes=down), "swarm")
    assert c.ok is False and "advertise 2" in c.text and "node-generic-resources" in c.fix
    other_kind = only(d.check_gpus, topo(GPU, "swarm: {gpu_resource: NVIDIA-GPU}\n"), facts(nodes=nodes), "swarm")
    assert other_kind.ok is False


def test_shm() -> None:
    assert only(d.check_shm, topo(), facts()).ok
    # 2g + 3 x 4g, and the exchange's segments: each worker's push slot and reply buffer (async)
    c = only(d.check_shm, topo(GPU), facts(info=dict(INFO, MemTotal=8 * GIB)))
    assert c.ok is False and "14.3 GiB" in c.text and "workers.shm_size" in c.fix
    assert "one for the job" in c.text and "0.3 GiB of it the exchange's shared memory (resnet18, 3 workers)" in c.text
    small = topo(
        CPU.replace("  log_every: 10", "  log_every: 10\n  loader_workers: 2").replace(
            "  count: 2\n  shm_size: 256m", "  count: 2\n  shm_size: 64m"
        )
    )
    c = only(d.check_shm, small, facts())
    assert c.ok is False and "DataLoader" in c.text


def test_data_dir() -> None:
    assert only(d.check_data, topo(), facts()).text.startswith("not needed")
    c = only(d.check_data, topo(GPU), facts(data_problem="is empty", data_dir="/x"))
    assert c.ok is False and c.text.startswith("train.data_dir: ./data/imagenette2/val is empty")
    assert only(d.check_data, topo(GPU), facts(data_dir="/x")).ok
    assert "every node" in only(d.check_data, topo(GPU), facts(data_dir="/x"), "swarm").text


def test_disk() -> None:
    assert only(d.check_disk, topo(), facts()).ok
    c = only(d.check_disk, topo(GPU), facts(disk_free=10 * GIB, image_present=False))
    assert c.ok is False and "need 20.0 GiB" in c.text
    assert only(d.check_disk, topo(GPU), facts(disk_free=10 * GIB, image_present=True)).ok
    # only the app's layers to build on a base that is there: a full disk's last GiBs will do
    layers = only(d.check_disk, topo(), facts(disk_free=int(1.7 * GIB), image_present=False, base_present=True))
    assert layers.ok and "which is present" in layers.text
    c = only(d.check_disk, topo(), facts(disk_free=1 * GIB, image_present=False, base_present=True))
    assert c.ok is False and "need 1.2 GiB" in c.text
    c = only(d.check_disk, topo(), facts(disk_free=int(2.5 * GIB), image_present=False))
    assert c.ok is False and "need 4.0 GiB" in c.text
    assert only(d.check_disk, topo(), facts(disk_free=None)).ok  # a remote daemon: not ours to measure


def test_rpc_port() -> None:
    c = only(d.check_port, topo(), facts())
    assert c.ok and "not published" in c.text
    published = topo(CPU + "network: {publish_rpc_port: true}\n")
    c = only(d.check_port, published, facts(port_in_use=False))
    assert c.ok and "prove the run's secret" in c.text and "firewall it" in c.text
    c = only(d.check_port, published, facts(port_in_use=True))
    assert c.ok is False and "already in use" in c.text


def test_swarm_state() -> None:
    active = dict(INFO, Swarm={"LocalNodeState": "active", "ControlAvailable": True, "Nodes": 1})
    assert only(d.check_swarm, topo(), facts(info=active, nodes=[NODE]), "swarm").ok
    c = only(d.check_swarm, topo(), facts(), "swarm")
    assert c.ok is False and "docker swarm init" in c.fix
    worker = dict(INFO, Swarm={"LocalNodeState": "active", "ControlAvailable": False})
    assert "from a manager" in only(d.check_swarm, topo(), facts(info=worker), "swarm").text


def test_placement() -> None:
    placed = topo(CPU, "swarm: {ps: gpu-a, workers: [zone=a]}\n")
    assert only(d.check_placement, placed, facts(nodes=[NODE]), "swarm").ok
    c = only(d.check_placement, topo(CPU, "swarm: {workers: [gpu-a, gpu-z]}\n"), facts(nodes=[NODE]), "swarm")
    assert c.ok is False and "worker2" in c.text and "'gpu-z'" in c.text and "gpu-a" in c.text
    assert only(d.check_placement, topo(CPU, "swarm: {workers: [zone=b]}\n"), facts(nodes=[NODE]), "swarm").ok is False
    assert only(d.check_placement, topo(), facts(), "swarm").ok  # no constraints


def test_no_daemon_skips_what_needs_it() -> None:
    checks = d.run_checks(topo(), "swarm", d.Facts(daemon_error="no socket", stack_cli="/usr/bin/docker"))
    by_name = {c.name: c.ok for c in checks}
    assert by_name["daemon"] is False and by_name["swarm"] is None and by_name["disk"] is None
    out = io.StringIO()
    assert d.report(checks, out) is False
    assert "1 problem(s), 3 not checked" in out.getvalue()


def test_report_one_line_per_check() -> None:
    checks = d.run_checks(topo(GPU), "compose", facts(data_dir="/x"))
    out = io.StringIO()
    assert d.report(checks, out) is False
    lines = out.getvalue().splitlines()
    assert len(lines) == len(checks) + 1
    assert lines[2].startswith("PROBLEM  nvidia        image.device is cuda") and "-> fix: install" in lines[2]
    assert lines[0].startswith("ok       daemon")
    assert d.report(d.run_checks(topo(), "compose", facts()), io.StringIO()) is True


def test_a_probe_not_run_is_listed_as_such_and_not_counted_as_passed() -> None:
    # A GPU topology on a host whose engine has the nvidia runtime (the recorded payload),
    # every other check fine, the probe not run (--no-probe, as `up`'s preflight).
    import json

    nvidia = json.loads((REPO / "tests/orchestrator/docker_info/nvidia-runtime.json").read_text())
    t = topo(GPU)
    f = facts(info=nvidia, api_version="1.51", gpus=[0, 1, 2, 3], data_dir=str(REPO))
    checks = d.run_checks(t, "compose", f)
    probe = next(c for c in checks if c.name == "probe")
    assert probe.not_run and not probe.passed
    others = [c for c in checks if c.name != "probe"]
    assert all(c.passed for c in others), [c.line() for c in others]
    out = io.StringIO()
    assert d.report(checks, out) is True  # not a problem: `up` starts, gpu-check runs the probe
    lines = out.getvalue().splitlines()
    assert "not run  probe         --no-probe; `make gpu-check` runs it" in lines
    assert lines[-1] == f"doctor: {len(others)} checks passed, 1 not run (probe)"
    assert d.summary(checks) == f"{len(others)} checks passed, 1 not run (probe)"
    # Beside a problem, the count of checks passed leaves it out too.
    checks = d.run_checks(t, "compose", facts(info=nvidia, api_version="1.51", gpus=None, data_dir=str(REPO)))
    out = io.StringIO()
    assert d.report(checks, out) is False
    passed = sum(c.ok is True for c in checks) - 1
    assert out.getvalue().splitlines()[-1].endswith(f" {passed} ok, 1 not run"), out.getvalue()


def test_stop_on_problems_names_the_first_one() -> None:
    checks = d.run_checks(topo(GPU), "compose", facts(gpus=None, data_dir="/x"))
    with pytest.raises(UsageError) as e:
        d.stop_on_problems(checks, "configs/default.yaml", "CONFIG=x runs anywhere")
    assert str(e.value).startswith(
        "configs/default.yaml: image.device is cuda, but this Docker engine offers no "
        "GPU: no NVIDIA runtime, no CDI nvidia.com/gpu device, no NVIDIA hook "
        "(install the NVIDIA Container Toolkit"
    )
    assert (
        "(and 1 more: python -m orchestrator doctor -c configs/default.yaml); nothing was started. "
        "CONFIG=x runs anywhere" in str(e.value)
    )
    d.stop_on_problems(d.run_checks(topo(), "compose", facts()), "c.yaml", "")


# --- the failing conditions made real (gather asks the host) ----------------


def test_gather_sees_a_missing_and_an_empty_data_dir(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-dir"
    assert d.dir_problem(missing) == "is not a directory on this host: it does not exist"
    (tmp_path / "empty").mkdir()
    assert d.dir_problem(tmp_path / "empty") == "is empty"
    (tmp_path / "file").write_text("x")
    assert d.dir_problem(tmp_path / "file") == "is not a directory on this host: it is a file"
    (tmp_path / "empty" / "class0").mkdir()
    assert d.dir_problem(tmp_path / "empty") is None
    assert d.data_path("./data/x") == REPO / "data/x" and d.data_path(str(missing)) == missing


def test_gather_sees_a_port_in_use() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        port = s.getsockname()[1]
        assert d.port_in_use(port) is True
    assert d.port_in_use(port) is False


def run_doctor(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", "doctor", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def test_cli_no_daemon_at_a_bad_docker_host() -> None:
    p = run_doctor("-c", "configs/cpu-smoke.yaml", env={"DOCKER_HOST": "tcp://127.0.0.1:1"})
    assert p.returncode == 1, p.stdout + p.stderr
    assert "PROBLEM  daemon        cannot reach the Docker daemon at tcp://127.0.0.1:1 (connection refused)" in p.stdout


def test_cli_missing_data_dir_and_port_in_use(tmp_path: Path) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        port = s.getsockname()[1]
        config = tmp_path / "t.yaml"
        config.write_text(
            CPU.replace("dataset: digits", f"dataset: imagefolder\n  data_dir: {tmp_path}/none").replace(
                "rpc_timeout: 60", f"rpc_timeout: 60\n  rpc_port: {port}"
            )
            + "network: {publish_rpc_port: true}\n"
        )
        p = run_doctor("-c", str(config))
    assert p.returncode == 1, p.stdout + p.stderr
    assert f"train.data_dir: {tmp_path}/none is not a directory on this host: it does not exist" in p.stdout
    assert f"PROBLEM  rpc port      {port} is published (network.publish_rpc_port) but already in use" in p.stdout


def test_cli_bad_config_is_exit_2(tmp_path: Path) -> None:
    p = run_doctor("-c", str(tmp_path / "none.yaml"))
    assert p.returncode == 2 and "no such file" in p.stderr


@pytest.mark.docker
def test_cli_all_pass_on_this_engine() -> None:
    """The CPU topology on this machine's engine: every check passes, exit 0."""
    p = run_doctor("-c", "configs/cpu-smoke.yaml")
    if "PROBLEM  daemon" in p.stdout:
        unavailable("no Docker engine answers (doctor: PROBLEM  daemon)")
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.rstrip().endswith("doctor: all 10 checks passed")


def test_missing_data_dir_says_how_to_get_it():
    resnet = topo((REPO / "configs/cpu-resnet.yaml").read_text())
    check = d.check_data(resnet, "compose", facts(data_problem="is not a directory on this host: it does not exist"))
    assert check.ok is False and check.fix == "make sample-data writes it", check.line()
    other = topo(GPU)
    check = d.check_data(other, "compose", facts(data_problem="is not a directory on this host: it does not exist"))
    assert check.ok is False and check.fix == "put the data there, or change train.data_dir", check.line()
