"""The render: whole-document golden files, the schema, determinism, safe defaults."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from orchestrator.render import compose as render_compose
from orchestrator.render import tracking as render_tracking
from orchestrator.render.yamlio import write_atomic
from orchestrator.topology.model import Topology, load, parse
from orchestrator.topology.services import LABEL_PROJECT, LABEL_RANK, LABEL_ROLE, PIDNS_SERVICE, service_names

from orch_helpers import HERE, REPO, topology, training

GOLDEN = HERE / "golden"
# (golden file, config, --workers)
CASES = [
    ("default.yaml", "configs/default.yaml", None),
    ("default-workers1.yaml", "configs/default.yaml", 1),
    ("default-workers8.yaml", "configs/default.yaml", 8),
    ("cpu-smoke.yaml", "configs/cpu-smoke.yaml", None),
    ("cpu-smoke-workers1.yaml", "configs/cpu-smoke.yaml", 1),
    ("cpu-smoke-workers8.yaml", "configs/cpu-smoke.yaml", 8),
    ("cpu-resnet.yaml", "configs/cpu-resnet.yaml", None),
    ("custom-example.yaml", "examples/custom/topology.yaml", None),
]
IDS = [c[0] for c in CASES]


def rendered(config: str, workers: int | None) -> tuple[Topology, str]:
    t = load(REPO / config)
    if workers is not None:
        t = t.with_workers(workers)
    return t, render_compose.dump(render_compose.render(t), t.name)


@pytest.mark.parametrize("golden,config,workers", CASES, ids=IDS)
def test_golden(golden: str, config: str, workers: int | None) -> None:
    _, text = rendered(config, workers)
    path = GOLDEN / golden
    if os.environ.get("UPDATE_GOLDEN") == "1":
        path.write_text(text)
    assert path.exists(), f"no {path}: run with UPDATE_GOLDEN=1 (tests/orchestrator/README.md)"
    assert text == path.read_text(), f"render differs from {path}; if intended: UPDATE_GOLDEN=1"


def test_top_level_compose_yaml_is_up_to_date() -> None:
    _, text = rendered("configs/default.yaml", None)
    assert (REPO / "compose.yaml").read_text() == text, (
        "compose.yaml is out of date with configs/default.yaml: run `make render`"
    )


@pytest.mark.parametrize("golden,config,workers", CASES, ids=IDS)
def test_schema(schema_validator, golden: str, config: str, workers: int | None) -> None:
    _, text = rendered(config, workers)
    errors = [
        f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
        for e in schema_validator.iter_errors(yaml.safe_load(text))
    ]
    assert errors == []


def test_schema_rejects_garbage(schema_validator) -> None:
    # The check has teeth: a key compose does not know is an error.
    doc = yaml.safe_load(rendered("configs/cpu-smoke.yaml", None)[1])
    doc["services"]["ps"]["gpus_please"] = 1
    assert list(schema_validator.iter_errors(doc))


def test_same_topology_same_bytes(tmp_path: Path) -> None:
    t = load(REPO / "configs/default.yaml")
    assert render_compose.dump(render_compose.render(t), t.name) == render_compose.dump(
        render_compose.render(load(REPO / "configs/default.yaml")), t.name
    )
    # And across processes (hash seeds differ), through the CLI.
    outs = []
    for seed in ("1", "2"):
        out = tmp_path / f"c{seed}.yaml"
        subprocess.run(
            [sys.executable, "-m", "orchestrator", "render", "-o", str(out)],
            cwd=REPO,
            env={**os.environ, "PYTHONHASHSEED": seed},
            check=True,
            capture_output=True,
        )
        outs.append(out.read_bytes())
    assert outs[0] == outs[1] == (REPO / "compose.yaml").read_bytes()


def test_no_anchors_no_name_no_version() -> None:
    for _, config, workers in CASES:
        _, text = rendered(config, workers)
        events = list(yaml.parse(text))
        assert not any(isinstance(e, yaml.AliasEvent) or getattr(e, "anchor", None) for e in events)
        doc = yaml.safe_load(text)
        assert list(doc) == ["services", "networks", "volumes"]


def test_services_ranks_and_env() -> None:
    t, text = rendered("configs/default.yaml", 4)
    doc = yaml.safe_load(text)
    assert list(training(doc)) == ["ps", "worker1", "worker2", "worker3", "worker4"] == service_names(t)
    for rank, (_name, svc) in enumerate(training(doc).items()):
        env = svc["environment"]
        assert env["PSC_RANK"] == str(rank) and env["PSC_WORLD_SIZE"] == "5"
        assert env["PSC_MASTER_ADDR"] == "ps" and env["PSC_MASTER_PORT"] == "29500"
        assert env["PSC_DATA_DIR"] == "/data" and env["GLOO_SOCKET_IFNAME"] == "eth0"
        assert env["PSC_CHECKPOINT_DIR"] == "/state/checkpoints" and env["PSC_METRICS_DIR"] == "/state/metrics"
        # The PS's MLflow credentials are names, compose's null: taken from the caller, never written.
        passed = {k for k, v in env.items() if v is None}
        assert passed == (set(render_tracking.FROM_CALLER) if rank == 0 else set())
        assert all(isinstance(v, str) for k, v in env.items() if k not in passed)
        assert svc["command"] == (["ps"] if rank == 0 else ["worker"])
        assert svc["labels"] == {
            LABEL_PROJECT: t.name,
            LABEL_ROLE: "ps" if rank == 0 else "worker",
            LABEL_RANK: str(rank),
        }
        assert svc["networks"] == [render_compose.NETWORK]
        assert svc["image"] == "ps-compose-resnet18-imagenette:latest"
    assert doc["networks"] == {"cluster": {"driver": "bridge", "labels": {LABEL_PROJECT: t.name}}}


def test_gpu_mode() -> None:
    doc = yaml.safe_load(rendered("configs/default.yaml", 3)[1])
    for i in (1, 2, 3):
        w = doc["services"][f"worker{i}"]
        assert w["deploy"] == {
            "resources": {
                "reservations": {"devices": [{"driver": "nvidia", "device_ids": [str(i - 1)], "capabilities": ["gpu"]}]}
            }
        }
        assert w["environment"]["PSC_DEVICE"] == "cuda"
    ps = doc["services"]["ps"]
    assert "deploy" not in ps and ps["environment"]["PSC_DEVICE"] == "cpu"


def test_gpu_for_ps_when_asked_and_listed_gpus() -> None:
    t = parse(yaml.safe_dump(topology(image={"device": "cuda"}, ps={"gpu": 7}, workers={"count": 2, "gpus": [4, 2]})))
    doc = render_compose.render(t)
    ids = {n: s["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] for n, s in training(doc).items()}
    assert ids == {"ps": ["7"], "worker1": ["4"], "worker2": ["2"]}
    assert doc["services"]["ps"]["environment"]["PSC_DEVICE"] == "cuda"


def test_cpu_mode_has_no_reservations_and_no_data_mount() -> None:
    doc = yaml.safe_load(rendered("configs/cpu-smoke.yaml", None)[1])
    for svc in training(doc).values():
        assert "deploy" not in svc and svc["environment"]["PSC_DEVICE"] == "cpu"
        assert "PSC_DATA_DIR" not in svc["environment"]
        assert svc["volumes"] == [
            {"type": "volume", "source": "state", "target": "/state"},
            {"type": "volume", "source": "exchange", "target": "/run/psc"},
        ]


def test_safe_defaults() -> None:
    for _, config, workers in CASES:
        doc = yaml.safe_load(rendered(config, workers)[1])
        pidns = doc["services"][PIDNS_SERVICE]
        for name, svc in training(doc).items():
            assert "ports" not in svc and "privileged" not in svc and "network_mode" not in svc
            assert svc["user"] == "1000:1000"
            assert svc["cap_drop"] == ["ALL"] and svc["security_opt"] == ["no-new-privileges:true"]
            # the one capability: lets the seccomp profile pass process_vm_readv (same_host_copy)
            assert "cap_add" not in svc and svc["pid"] == f"service:{PIDNS_SERVICE}"
            assert svc["init"] is False  # the pidns service's tini is the namespace's PID 1
            # /dev/shm is the holder's (the PS's shared memory is every worker's): none of its own
            assert svc["ipc"] == f"service:{PIDNS_SERVICE}" and "shm_size" not in svc
            for v in svc["volumes"]:
                if v["type"] == "bind":
                    assert v["read_only"] is True and v["target"] in ("/data", "/code", "/init/weights.pt")
            if name == "ps":
                assert svc["healthcheck"]["test"] == ["CMD", "python", "-m", "app", "health"]
                assert "build" in svc
                assert svc["depends_on"] == {PIDNS_SERVICE: {"condition": "service_started"}}
            else:
                assert svc["depends_on"] == {
                    PIDNS_SERVICE: {"condition": "service_started"},
                    "ps": {"condition": "service_healthy"},
                }
                assert svc["restart"] == "on-failure" and "build" not in svc
        # the holder: tini and a wait loop, as the app's user, no network, capability, mount or port
        assert pidns["entrypoint"] == ["python", "-m", "app.pidns"] and pidns["init"] is True
        assert pidns["user"] == "1000:1000" and pidns["cap_drop"] == ["ALL"] and "cap_add" not in pidns
        assert pidns["security_opt"] == ["no-new-privileges:true"] and pidns["network_mode"] == "none"
        assert pidns["ipc"] == "shareable" and pidns["shm_size"].endswith("m")
        assert not {"volumes", "ports", "pid", "deploy", "privileged"} & set(pidns)
        project = {LABEL_PROJECT: yaml.safe_load(Path(REPO / config).read_text())["name"]}
        assert doc["volumes"]["state"] == {"labels": project}
        # the run's secret and UNIX sockets: a tmpfs only the job's containers mount, the app's user's alone
        assert doc["volumes"]["exchange"] == {
            "driver": "local",
            "driver_opts": {"type": "tmpfs", "device": "tmpfs", "o": "uid=1000,gid=1000,mode=0700,size=1m"},
            "labels": project,
        }
        for svc in training(doc).values():
            assert {"type": "volume", "source": "exchange", "target": "/run/psc"} in svc["volumes"]
            assert svc["environment"]["PSC_SECRET_FILE"] == "/run/psc/secret"
            assert svc["environment"]["PSC_SOCKET_DIR"] == "/run/psc"
        assert set(doc["volumes"]) == {"state", "exchange"}


def test_same_host_copy_off_gives_each_container_its_own_pid_namespace_and_no_capability() -> None:
    t = parse(yaml.safe_dump(topology(network={"same_host_copy": False})))
    services = render_compose.render(t)["services"]
    assert PIDNS_SERVICE not in services
    for svc in services.values():
        assert svc["init"] is True and svc["cap_drop"] == ["ALL"]
        assert "cap_add" not in svc and "pid" not in svc


def test_other_hosts_share_no_pid_namespace() -> None:
    """Swarm spreads the job over nodes (an allreduce job's holder on one host:
    tests/orchestrator/test_render_allreduce.py)."""
    allreduce = parse(yaml.safe_dump(topology(train={"strategy": "allreduce"})))
    assert PIDNS_SERVICE not in render_compose.render(allreduce, one_host=False)["services"]
    t = parse(yaml.safe_dump(topology()))
    assert PIDNS_SERVICE not in render_compose.render(t, one_host=False)["services"]
    assert all("pid" not in s for s in render_compose.render(t, one_host=False)["services"].values())


def test_data_mount() -> None:
    doc = yaml.safe_load(rendered("configs/default.yaml", None)[1])
    assert doc["services"]["worker2"]["volumes"][0] == {
        "type": "bind",
        "source": "./data/imagenette2/val",
        "target": "/data",
        "read_only": True,
    }
    t = parse(yaml.safe_dump(topology(train={"dataset": "mnist", "data_dir": "data/mnist"})))
    assert render_compose.render(t)["services"]["ps"]["volumes"][0]["source"] == "./data/mnist"


def test_build_args() -> None:
    doc = yaml.safe_load(rendered("configs/cpu-smoke.yaml", None)[1])
    assert doc["services"]["ps"]["build"] == {
        "context": ".",
        "dockerfile": "images/Dockerfile",
        "args": {"BASE_IMAGE": "ps-compose-base:bookworm", "PIP_SOURCE": "wheelhouse"},
    }


def test_publish_rpc_port_when_asked(cli, write_config) -> None:
    t = parse(yaml.safe_dump(topology(network={"publish_rpc_port": True}, ps={"rpc_port": 29600})))
    assert render_compose.render(t)["services"]["ps"]["ports"] == ["29600:29600"]
    assert all("ports" not in s for n, s in training(render_compose.render(t)).items() if n != "ps")
    status, out, err = cli("render", "-c", str(write_config(topology(network={"publish_rpc_port": True}))), "-o", "-")
    assert status == 0 and "ports:" in out
    assert err.startswith("warning: network.publish_rpc_port:") and "prove the run's secret" in err
    assert "firewall it" in err


def test_render_is_pure(monkeypatch: pytest.MonkeyPatch) -> None:
    t = load(REPO / "configs/default.yaml")

    def no_io(*a, **k):
        raise AssertionError("render touched the disk")

    monkeypatch.setattr("builtins.open", no_io)
    monkeypatch.setattr(os, "stat", no_io)
    render_compose.dump(render_compose.render(t), t.name)


def test_project_name() -> None:
    assert render_compose.project_name(load(REPO / "configs/cpu-smoke.yaml")) == "cpu-smoke"


def test_cli_render_writes_whole_file(cli, tmp_path: Path) -> None:
    status, out, err = cli("render", "-c", str(REPO / "configs/cpu-smoke.yaml"), "-o", "c.yaml")
    assert (status, err) == (0, "") and out.startswith("wrote c.yaml: ps + 2 workers")
    assert (tmp_path / "c.yaml").read_text() == rendered("configs/cpu-smoke.yaml", None)[1]
    assert (tmp_path / "c.yaml").stat().st_mode & 0o777 == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.yaml"]


def test_cli_render_stdout(cli, tmp_path: Path) -> None:
    status, out, err = cli("render", "-c", str(REPO / "configs/cpu-smoke.yaml"), "--workers", "3", "-o", "-")
    assert (status, err) == (0, "") and out == rendered("configs/cpu-smoke.yaml", 3)[1]
    assert list(tmp_path.iterdir()) == []


def test_failed_write_leaves_no_temp_and_old_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    target = tmp_path / "compose.yaml"
    target.write_text("old\n")

    def boom(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError):
        write_atomic(target, "new\n")
    assert target.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["compose.yaml"]


def test_image_size_is_rendered_only_when_it_is_not_the_apps_default() -> None:
    resnet = yaml.safe_load(rendered("configs/cpu-resnet.yaml", None)[1])
    assert resnet["services"]["worker1"]["environment"]["PSC_IMAGE_SIZE"] == "32"
    assert resnet["services"]["ps"]["environment"]["PSC_IMAGE_SIZE"] == "32"
    default = yaml.safe_load(rendered("configs/default.yaml", None)[1])
    assert "PSC_IMAGE_SIZE" not in default["services"]["worker1"]["environment"]  # 224, the app's own


def test_tensorboard_is_a_profiled_service_on_the_state_volume_read_only_published_on_loopback():
    _, text = rendered("configs/cpu-smoke.yaml", None)
    doc = yaml.safe_load(text)
    tb = doc["services"][render_compose.TENSORBOARD_SERVICE]
    ps = doc["services"]["ps"]
    assert tb["profiles"] == [render_compose.TENSORBOARD_PROFILE]  # `up` never starts it
    assert tb["image"] == ps["image"] and "build" not in tb
    assert tb["volumes"] == [{"type": "volume", "source": "state", "target": "/state", "read_only": True}]
    assert tb["ports"] == ["127.0.0.1:${PSC_TENSORBOARD_PORT:-6006}:6006"]
    assert tb["command"][:2] == ["--logdir", "/state/metrics/tensorboard/${PSC_TENSORBOARD_RUN:-}"]
    for key in ("user", "cap_drop", "security_opt", "networks"):
        assert tb[key] == ps[key], key
    # its own PID namespace and init: it reads the volume, it never talks to the job
    assert tb["init"] is True and "pid" not in tb and "cap_add" not in tb


def test_workers_above_count_are_rendered_under_the_scale_profile_with_their_gpus(schema_validator) -> None:
    t = parse(yaml.safe_dump(topology(image={"device": "cuda"}, workers={"count": 2, "max": 4})))
    doc = render_compose.render(t)
    workers = {n: s for n, s in doc["services"].items() if n.startswith("worker")}
    assert list(workers) == ["worker1", "worker2", "worker3", "worker4"]
    assert [s.get("profiles") for s in workers.values()] == [None, None, ["scale"], ["scale"]]
    devices = [s["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] for s in workers.values()]
    assert devices == [["0"], ["1"], ["2"], ["3"]]  # one GPU reserved per possible worker
    for svc in training(doc).values():  # the PS admits ranks up to 4; world size stays that of the start
        assert svc["environment"]["PSC_MAX_WORKERS"] == "4" and svc["environment"]["PSC_WORLD_SIZE"] == "3"
    assert list(schema_validator.iter_errors(yaml.safe_load(render_compose.dump(doc, t.name)))) == []


def test_without_workers_max_nothing_changes() -> None:
    t, _ = rendered("configs/cpu-smoke.yaml", None)
    doc = render_compose.render(t)
    assert t.max_workers == t.workers.count
    assert all("profiles" not in s and "PSC_MAX_WORKERS" not in s["environment"] for s in training(doc).values())
