"""The GPU path without a GPU: the rendered GPU file (NVIDIA_VISIBLE_DEVICES void,
NCCL_SOCKET_IFNAME, image.group_add), doctor's GPU checks on recorded `docker info`
payloads (docker_info/README.md says where each shape comes from), and the probe's report."""

from __future__ import annotations

import json

import jsonschema
import pytest
import yaml

from orchestrator.render import compose as render_compose
from orchestrator.render import swarm as render_swarm
from orchestrator.topology.model import Topology, TopologyError, parse

import doctor_kit as d
from orch_helpers import HERE, REPO, training

GPU = (REPO / "configs/default.yaml").read_text()
CPU = (REPO / "configs/cpu-smoke.yaml").read_text()
INFO = HERE / "docker_info"


def gpu_topology(group_add: str = "", ifname: str = "", ps_gpu: bool = False) -> Topology:
    text = GPU
    if group_add:
        text = text.replace("  device: cuda", f"  device: cuda\n  group_add: {group_add}", 1)
    if ifname:
        text += f"network: {{ifname: {ifname}}}\n" if "\nnetwork:" not in text else ""
        text = text.replace("ifname: eth0", f"ifname: {ifname}")
    if ps_gpu:
        text = text.replace("  # gpu: 0 ", "  gpu: 3 ")
    return parse(text, "t.yaml")


def info(name: str) -> dict:
    return json.loads((INFO / f"{name}.json").read_text())


# --- the rendered GPU file ---------------------------------------------------------


def test_the_ps_without_a_gpu_sees_none_and_workers_keep_theirs() -> None:
    services = training(render_compose.render(gpu_topology()))
    assert services["ps"]["environment"]["NVIDIA_VISIBLE_DEVICES"] == "void"
    assert "deploy" not in services["ps"]
    for name in ("worker1", "worker2", "worker3"):
        assert "NVIDIA_VISIBLE_DEVICES" not in services[name]["environment"]
        assert services[name]["deploy"]["resources"]["reservations"]["devices"][0]["driver"] == "nvidia"
    # A PS with a GPU of its own reserves it and is not voided.
    ps = training(render_compose.render(gpu_topology(ps_gpu=True)))["ps"]
    assert "NVIDIA_VISIBLE_DEVICES" not in ps["environment"]
    assert ps["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] == ["3"]


def test_cpu_topologies_get_no_gpu_variables() -> None:
    for svc in training(render_compose.render(parse(CPU, "c.yaml"))).values():
        assert "NVIDIA_VISIBLE_DEVICES" not in svc["environment"] and "NCCL_SOCKET_IFNAME" not in svc["environment"]


def test_nccl_follows_network_ifname_like_gloo() -> None:
    t = gpu_topology(ifname="ens5")
    for doc in (render_compose.render(t), render_swarm.render(t, data_root="/srv")):
        for svc in training(doc).values():
            env = svc["environment"]
            assert env["NCCL_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"] == "ens5"
    allreduce = parse(GPU.replace("strategy: async", "strategy: allreduce"), "a.yaml")
    assert {
        s["environment"]["NCCL_SOCKET_IFNAME"]
        for s in training(render_compose.render(allreduce, one_host=False)).values()
    } == {"eth0"}
    # on one host the ranks share a network namespace: NCCL, as Gloo, on its loopback
    assert {s["environment"]["NCCL_SOCKET_IFNAME"] for s in training(render_compose.render(allreduce)).values()} == {
        "lo"
    }


def test_group_add_goes_to_every_gpu_container_only() -> None:
    services = training(render_compose.render(gpu_topology(group_add="[44, render]")))
    assert "group_add" not in services["ps"]
    assert [services[f"worker{k}"]["group_add"] for k in (1, 2, 3)] == [[44, "render"]] * 3
    assert training(render_compose.render(gpu_topology(group_add="[44]", ps_gpu=True)))["ps"]["group_add"] == [44]
    assert "group_add" not in training(render_compose.render(gpu_topology()))["worker1"]  # unset: as before


def test_group_add_is_valid_compose_and_left_out_of_the_stack() -> None:
    t = gpu_topology(group_add="[44, render]", ps_gpu=True)
    schema = json.loads((HERE / "compose-spec.json").read_text())
    jsonschema.Draft7Validator(schema).validate(yaml.safe_load(render_compose.dump(render_compose.render(t), t.name)))
    stack = render_swarm.render(t, data_root="/srv")
    assert all("group_add" not in svc for svc in stack["services"].values())  # docker stack deploy rejects it
    assert stack["services"]["ps"]["environment"]["NCCL_SOCKET_IFNAME"] == "eth0"


@pytest.mark.parametrize(
    "value,problem",
    [
        ("[-1]", "image.group_add[0]: got -1; must be a group id (a number >= 0, e.g. 44) or a group name like video"),
        ("[true]", "image.group_add[0]: got True; must be a group id"),
        ("['Video Group']", "image.group_add[0]: got 'Video Group'; must be a group id"),
        ("44", "image.group_add: got 44; must be a valid list"),
    ],
)
def test_bad_group_add_is_one_line(value: str, problem: str) -> None:
    with pytest.raises(TopologyError) as e:
        gpu_topology(group_add=value)
    assert str(e.value).startswith("t.yaml: " + problem)


def test_group_add_on_cpu_is_refused() -> None:
    with pytest.raises(TopologyError, match=r"image.group_add: got \[44\]; allowed only with image.device cuda"):
        parse(CPU.replace("  device: cpu", "  device: cpu\n  group_add: [44]"), "c.yaml")


# --- doctor on recorded docker info payloads --------------------------------------


def facts(payload: str, **kw) -> d.Facts:
    base = dict(
        info=info(payload),
        api_version="1.51",
        compose="docker compose (compose v2)",
        gpus=None,
        disk_free=100 * 1024**3,
        image_present=True,
    )
    base.update(kw)
    return d.Facts(**base)


def test_a_runtime_configured_host_passes() -> None:
    c = d.check_nvidia(gpu_topology(), "compose", facts("nvidia-runtime", gpus=[0, 1, 2, 3]))
    assert c.ok and c.text == "GPUs reach containers through the nvidia runtime"
    assert d.check_gpus(gpu_topology(), "compose", facts("nvidia-runtime", gpus=[0, 1, 2, 3])).ok


def test_a_cdi_only_host_passes_and_its_devices_name_the_gpus() -> None:
    f = facts("cdi-only")
    assert "nvidia" not in f.info["Runtimes"]
    c = d.check_nvidia(gpu_topology(), "compose", f)
    assert c.ok and c.text.startswith("GPUs reach containers through CDI devices nvidia.com/gpu=0,1,2,3,GPU-")
    g = d.check_gpus(gpu_topology(), "compose", f)  # no nvidia-smi here: the CDI index names tell
    assert g.ok and g.text == "GPU ids [0, 1, 2] present (host has [0, 1, 2, 3], from the engine's CDI devices)"
    many = parse(GPU.replace("count: 3", "count: 5"), "t.yaml")
    bad = d.check_gpus(many, "compose", f)
    assert (
        bad.ok is False and bad.text == "GPU id(s) [4] not on this host (the engine's CDI devices lists [0, 1, 2, 3])"
    )


def test_docker_desktop_wsl2_passes_without_any_runtime() -> None:
    f = facts("docker-desktop-wsl2")
    c = d.check_nvidia(gpu_topology(), "compose", f)
    assert c.ok and c.text == "GPUs reach containers through Docker Desktop's WSL 2 GPU support"


def test_a_host_with_only_the_hook_passes() -> None:
    f = facts("no-gpu", hooks=["nvidia-container-runtime-hook"])
    c = d.check_nvidia(gpu_topology(), "compose", f)
    assert c.ok and "nvidia-container-runtime-hook on the daemon's host" in c.text
    spec = facts("no-gpu", cdi_specs=["/var/run/cdi/nvidia.yaml"])
    assert d.check_nvidia(gpu_topology(), "compose", spec).text.endswith("the CDI spec /var/run/cdi/nvidia.yaml")


def test_a_host_with_no_gpu_fails_with_one_line_that_says_what_to_run() -> None:
    f = facts("no-gpu")
    assert "DiscoveredDevices" not in f.info  # API 1.41: the key does not exist yet
    c = d.check_nvidia(gpu_topology(), "compose", f)
    assert c.ok is False
    assert c.text == (
        "image.device is cuda, but this Docker engine offers no GPU: no NVIDIA runtime, "
        "no CDI nvidia.com/gpu device, no NVIDIA hook"
    )
    assert "sudo nvidia-ctk runtime configure --runtime=docker" in c.fix and "\n" not in c.line()
    g = d.check_gpus(gpu_topology(), "compose", f)
    assert g.ok is False and "no nvidia-smi, no CDI GPU devices" in g.text and "nvidia-smi -L" in g.fix


def test_swarm_still_needs_the_nvidia_runtime_as_default() -> None:
    for payload in ("cdi-only", "docker-desktop-wsl2"):
        gpu_node = dict(info(payload), GenericResources=[{"DiscreteResourceSpec": {"Kind": "gpu", "Value": 4}}])
        c = d.check_nvidia(gpu_topology(), "swarm", facts(payload, info=gpu_node))
        assert c.ok is False and "no NVIDIA runtime" in c.text
    c = d.check_nvidia(gpu_topology(), "swarm", facts("nvidia-runtime"))
    assert c.ok is False and '"default-runtime": "nvidia"' in c.fix
    default = dict(info("nvidia-runtime"), DefaultRuntime="nvidia")
    assert d.check_nvidia(gpu_topology(), "swarm", facts("nvidia-runtime", info=default)).ok


# --- the probe's report ------------------------------------------------------------

H100 = {"name": "NVIDIA H100 80GB HBM3", "uuid": "GPU-4f5c2a1e-9b3d-7c60-2e8a-1d4b6f0c9a37"}


def report(**kw) -> str:
    data = {"uid": 1000, "groups": [1000], "denied": [], "gpus": [], "error": ""}
    data.update(kw)
    return "some warning on stderr\n" + d.PROBE_MARK + json.dumps(data) + "\n"


def test_probe_that_sees_its_gpus_passes() -> None:
    gpus = [H100, dict(H100, uuid="GPU-8a1b2c3d-4e5f-6071-8293-a4b5c6d7e8f9"), dict(H100, uuid="GPU-0c1d")]
    p = d.parse_probe([0, 1, 2], report(gpus=gpus), 0)
    c = d.check_probe(gpu_topology(), "compose", facts("nvidia-runtime", probe=p))
    assert c.ok and c.text.startswith("uid 1000 in ps-compose-resnet18-imagenette:latest sees GPU 0: NVIDIA H100")
    assert [g.id for g in p.gpus] == [0, 1, 2]


def test_probe_denied_a_device_node_names_the_group_to_add() -> None:
    p = d.parse_probe(
        [0], report(denied=[["/dev/nvidia0", "Permission denied", 44]], error="torch.cuda.is_available() is False"), 0
    )
    c = d.check_probe(gpu_topology(), "compose", facts("nvidia-runtime", probe=p))
    assert c.ok is False
    assert c.text == "uid 1000 cannot open /dev/nvidia0 in the container (Permission denied; its group is 44)"
    assert c.fix == "add image.group_add: [44] to the topology (the host group of /dev/nvidia0)"


def test_probe_failures_are_one_line_each() -> None:
    no_cuda = d.parse_probe([0], report(error="torch.cuda.is_available() is False"), 0)
    assert (
        d.check_probe(gpu_topology(), "compose", facts("nvidia-runtime", probe=no_cuda)).text
        == "in the probe container: torch.cuda.is_available() is False"
    )
    crashed = d.parse_probe([0], "Traceback (most recent call last):\n  ...\nImportError: libcuda.so.1\n", 1)
    assert crashed.error == "the probe container exited 1 without a report: ImportError: libcuda.so.1"
    fewer = d.parse_probe([0, 1], report(gpus=[H100]), 0)
    c = d.check_probe(gpu_topology(), "compose", facts("nvidia-runtime", probe=fewer))
    assert c.ok is False and c.text == "the probe asked for GPU ids [0, 1] and saw 1 GPU(s)"


def test_probe_not_run_and_not_needed() -> None:
    c = d.check_probe(gpu_topology(), "compose", facts("nvidia-runtime"))
    assert c.not_run and not c.passed and c.text == "--no-probe; `make gpu-check` runs it"
    assert c.line() == "not run  probe         --no-probe; `make gpu-check` runs it"
    note = "it runs in the image x:latest, not built yet (`make build`; `make gpu-check` builds it and probes)"
    c = d.check_probe(gpu_topology(), "compose", facts("nvidia-runtime", probe_note=note))
    assert c.not_run and c.text == note
    assert d.check_probe(parse(CPU, "c.yaml"), "compose", facts("no-gpu")).text == "not needed"
    c = d.check_probe(gpu_topology(), "compose", facts("no-gpu"))
    assert c.ok is None and c.text == "not run: no way to give it a GPU (see nvidia)"


def test_the_probe_script_runs_and_reports_on_a_host_without_gpus(tmp_path) -> None:
    # The script itself, here (no container, no GPU): it reports instead of crashing.
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", d.PROBE_SCRIPT], capture_output=True, text=True, timeout=120)
    p = d.parse_probe([0], out.stdout, out.returncode)
    assert out.returncode == 0 and p.error == "in the probe container: torch.cuda.is_available() is False"
    assert p.gpus == [] and p.uid is not None
