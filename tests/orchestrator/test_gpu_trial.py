"""`gpu-check`: the run's topology and the summary of its metrics (pure), the app's
`join` record naming its GPU, and the whole command on this GPU-less host: it stops
with the doctor's line, exit 1, having built and started nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from app.runtime import devices
from orchestrator.render import compose as render_compose
from orchestrator.topology.model import load, parse
from orchestrator.verbs import gpu_trial as g

from needs import unavailable
from orch_helpers import REPO, training

GPU = (REPO / "configs/default.yaml").read_text()


def test_the_run_is_cpu_smoke_on_the_projects_image_one_worker_per_gpu() -> None:
    t = parse(GPU.replace("  device: cuda", "  device: cuda\n  group_add: [44]"), "d.yaml")
    smoke = load(REPO / "configs/cpu-smoke.yaml")
    run = g.check_topology(t, [0, 2, 5], smoke)
    assert (run.name, run.image_tag, run.image.base, run.image.group_add) == (
        "gpu-check",
        "ps-compose-resnet18-imagenette:latest",
        t.image.base,
        [44],
    )
    assert (run.train.model, run.train.dataset, run.train.batch_size) == ("cnn", "digits", smoke.train.batch_size)
    assert run.cuda and run.worker_gpus() == [0, 2, 5] and run.ps_gpu() is None
    services = training(render_compose.render(run))
    assert [
        s["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] for n, s in services.items() if n != "ps"
    ] == [["0"], ["2"], ["5"]]
    assert services["ps"]["environment"]["NVIDIA_VISIBLE_DEVICES"] == "void"


def _lines(*records: dict) -> list[str]:
    return [json.dumps(rec) for rec in records]


A100 = "NVIDIA A100-SXM4-80GB"
FILES = {
    "worker1.jsonl": _lines(
        {"time": 100.0, "event": "join", "gpu": A100, "gpu_uuid": "GPU-aaaa"},
        {"time": 105.0, "event": "train", "samples_per_s": 900.0},  # warm-up
        {"time": 112.0, "event": "train", "samples_per_s": 3000.0},
        {"time": 114.0, "event": "train", "samples_per_s": 3200.0},
        {"time": 116.0, "event": "train", "samples_per_s": 3100.0},
    )
    + ['{"time": 1'],
    "worker2.jsonl": _lines(
        {"time": 101.0, "event": "join", "gpu": A100, "gpu_uuid": "GPU-bbbb"},
        {"time": 113.0, "event": "train", "samples_per_s": 2900.0},
    ),
}


def test_summary_per_worker_after_the_warm_up() -> None:
    rows = g.summarize(FILES, ["worker1", "worker2"], since=111.0)
    assert rows == [g.WorkerRow("worker1", 3100.0, A100, "GPU-aaaa"), g.WorkerRow("worker2", 2900.0, A100, "GPU-bbbb")]
    assert g.verdict(rows) == []
    assert g.format_rows(rows)[1] == f"worker1         3100  {A100:<28} GPU-aaaa"


def test_two_workers_on_one_gpu_or_no_gpu_fail() -> None:
    same = dict(
        FILES,
        **{"worker2.jsonl": [FILES["worker2.jsonl"][0].replace("GPU-bbbb", "GPU-aaaa")] + FILES["worker2.jsonl"][1:]},
    )
    rows = g.summarize(same, ["worker1", "worker2"], since=111.0)
    assert g.verdict(rows) == ["worker2 and worker1 saw the same GPU GPU-aaaa"]
    rows = g.summarize(FILES, ["worker1", "worker2", "worker3"], since=111.0)
    assert g.verdict(rows) == ["worker3: no train record after the warm-up", "worker3: its join record names no GPU"]


def test_the_join_record_names_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    assert devices.gpu_identity(torch.device("cpu")) == {}

    class Props:  # the two fields torch.cuda's device properties carry (name, uuid)
        name = A100
        uuid = "4f5c2a1e-9b3d-7c60-2e8a-1d4b6f0c9a37"

    assert {"name", "uuid"} <= set(dir(torch._C._CudaDeviceProperties))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Props())
    assert devices.gpu_identity(torch.device("cuda:0")) == {
        "gpu": A100,
        "gpu_uuid": "GPU-4f5c2a1e-9b3d-7c60-2e8a-1d4b6f0c9a37",
    }


def _engine_without_gpu() -> bool:
    try:
        import docker

        info = docker.from_env(timeout=10).info()
    except Exception:  # noqa: BLE001
        return False
    return "nvidia" not in (info.get("Runtimes") or {}) and not info.get("DiscoveredDevices")


def _engine_answers() -> bool:
    import docker

    try:
        docker.from_env(timeout=10).ping()
    except Exception:  # noqa: BLE001
        return False
    return True


@pytest.mark.docker
def test_gpu_check_on_a_host_without_gpu_stops_with_the_doctors_line() -> None:
    if not _engine_without_gpu():
        if not _engine_answers():
            unavailable("no Docker engine answers: make engine starts one")
        pytest.skip("needs a Docker engine with no GPU path (this host has one with a GPU)")
    ours = ["docker", "ps", "-aq", "--filter", "label=com.docker.compose.project=gpu-check"]
    probes = ["docker", "ps", "-aq", "--filter", "label=ps-compose.probe"]
    p = subprocess.run(
        [sys.executable, "-m", "orchestrator", "gpu-check"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert p.returncode == 1, p.stdout + p.stderr
    lines = p.stdout.splitlines()
    assert (
        "PROBLEM  nvidia        image.device is cuda, but this Docker engine offers no GPU: no NVIDIA runtime, "
        "no CDI nvidia.com/gpu device, no NVIDIA hook -> fix: install the NVIDIA Container Toolkit"
    ) in p.stdout
    assert lines[-1].startswith("gpu-check: stopped:") and lines[-1].endswith("nothing was started")
    assert "==>" not in p.stdout  # no build, no run
    for argv in (ours, probes):  # no run, no probe container was created
        assert subprocess.run(argv, capture_output=True, text=True).stdout == ""


def test_gpu_check_refuses_a_cpu_topology_and_bad_seconds() -> None:
    for argv, text in (
        (["-c", "configs/cpu-smoke.yaml"], "gpu-check needs a cuda topology"),
        (["--seconds", "0"], "--seconds"),
    ):
        p = subprocess.run(
            [sys.executable, "-m", "orchestrator", "gpu-check", *argv],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "PYTHONPATH": str(REPO), "DOCKER_HOST": "tcp://127.0.0.1:1"},
        )
        assert p.returncode == 2 and text in p.stderr, p.stdout + p.stderr
