"""status and smoke: the pure parts (metrics, states, verdicts). No engine needed."""

import copy
import io
import json
import tarfile
from pathlib import Path

import pytest

from orchestrator.backends import smoke
from orchestrator.backends.compose import doctor as compose_doctor
from orchestrator.backends.compose import status as compose_status
from orchestrator.backends.compose import verbs as compose_verbs
from orchestrator.doctor.checks import run_checks
from orchestrator.doctor.facts import Facts, data_path, dir_problem
from orchestrator.doctor.report import stop_on_problems
from orchestrator.errors import UsageError
from orchestrator.metrics import records
from orchestrator.topology.model import load, parse
from orchestrator.topology.services import services

PS_LINES = [
    '{"time": 1, "role": "ps", "rank": 0, "event": "eval", "step": 50, "accuracy": 0.78, "loss": 1.2}',
    '{"time": 2, "role": "ps", "rank": 0, "event": "end", "step": 220, "accuracy": 0.9666, "loss": 0.1243, '
    '"seconds": 1.6}',
]
WORKER_LINES = [
    '{"time": 1, "role": "worker", "rank": 1, "event": "train", "step": 10, "epoch": 1, "loss": 0.9, '
    '"samples_per_s": 500, "staleness": 1}',
    '{"time": 2, "role": "worker", "rank": 1, "event": "train", "step": 100, "epoch": 5, "loss": 0.0795, '
    '"samples_per_s": 510, "staleness": 2}',
    '{"time": 3, "role": "worker", "rank": 1, "event": "end", "step": 110}',
    '{"time": 4, "role": "wor',  # a line cut while being written
]


def attrs(service, status, exit_code=0, health=None, restarts=0):
    st = {"Status": status, "ExitCode": exit_code}
    if health:
        st["Health"] = {"Status": health}
    return {
        "Name": f"/p-{service}-1",
        "State": st,
        "RestartCount": restarts,
        "Config": {"Labels": {"com.docker.compose.service": service}},
    }


def test_summarize_metrics_keeps_the_last_values_and_skips_bad_lines():
    assert compose_status.summarize_metrics(WORKER_LINES) == {
        "step": 110,
        "loss": 0.0795,
        "accuracy": None,
        "event": "end",
    }
    assert compose_status.summarize_metrics(PS_LINES) == {
        "step": 220,
        "loss": 0.1243,
        "accuracy": 0.9666,
        "event": "end",
    }
    assert compose_status.summarize_metrics(["", "[1, 2]", "not json"])["step"] is None


def test_metrics_from_tar_reads_every_jsonl_file():
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, lines in (
            ("metrics/ps.jsonl", PS_LINES),
            ("metrics/worker1.jsonl", WORKER_LINES),
            ("metrics/notes.txt", ["x"]),
        ):
            data = "\n".join(lines).encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    assert records.metrics_from_tar(buf.getvalue()) == {"ps.jsonl": PS_LINES, "worker1.jsonl": WORKER_LINES}


def test_status_lines():
    rows = [
        compose_status.service_row("ps", attrs("ps", "running", health="healthy"), PS_LINES),
        compose_status.service_row("worker1", attrs("worker1", "exited", 0), WORKER_LINES),
        compose_status.service_row("worker2", attrs("worker2", "restarting", 1, restarts=2), []),
        compose_status.service_row("worker3", None, []),
    ]
    assert compose_status.format_status(rows) == [
        "SERVICE    STATE                  EXIT    STEP     LOSS ACCURACY",
        "ps         running (healthy)         -     220   0.1243   0.9666",
        "worker1    exited                    0     110   0.0795        -",
        "worker2    restarting x2             1       -        -        -",
        "worker3    no container              -       -        -        -",
    ]


def test_the_smoke_accuracy_is_rank_0s_last_end_record():
    lines = [
        json.dumps({"time": 1.0, "event": "eval", "step": 50, "accuracy": 0.7799}),
        json.dumps({"time": 2.0, "event": "end", "step": 200, "accuracy": 0.5}),
        "{broken",
        json.dumps({"time": 3.0, "event": "end", "step": 300, "accuracy": 0.9666}),
    ]
    assert records.final_accuracy(records.parse_lines(lines)) == 0.9666
    assert records.final_accuracy(records.parse_lines(lines[:1])) is None  # evaluations only: no end yet


def test_judge():
    ok = [compose_status.container_state(attrs(s, "exited")) for s in ("ps", "worker1", "worker2")]
    expected = ["ps", "worker1", "worker2"]
    assert smoke.judge(expected, ok, 0.95, 0.90) == []
    assert smoke.judge(expected, ok, 0.85, 0.90) == ["the PS's Accuracy 0.8500 < 0.90"]
    assert smoke.judge(expected, ok, None, 0.90) == ["the PS wrote no `end` record with its accuracy"]
    bad = [
        compose_status.container_state(attrs("ps", "exited")),
        compose_status.container_state(attrs("worker1", "exited", 1)),
        compose_status.container_state(attrs("worker2", "running")),
    ]
    assert smoke.judge(expected + ["worker3"], bad, 0.95, 0.90) == [
        "worker1: exit status 1",
        "worker2: still running",
        "worker3: no container",
    ]


CUDA = """
name: gpu
image: {base: pytorch/pytorch:2.8.0-cuda12.8-cudnn9-runtime, device: cuda}
train: {model: cnn, dataset: synthetic, batch_size: 8, lr: 0.1, epochs: 1}
workers: {count: 2}
"""


def _preflight(t, config, info, **facts):
    """What `up` does first (cluster.preflight), on given facts instead of the host's."""
    f = Facts(
        info={"MemTotal": 2**36, **info},
        target={"compose": "docker compose (compose v2)"},
        gpus=[0, 1],
        disk_free=2**40,
        **facts,
    )
    stop_on_problems(run_checks(compose_doctor.CHECKS, t, f), config, compose_verbs.CPU_HINT)


def test_preflight_stops_a_gpu_topology_without_the_nvidia_runtime():
    t = parse(CUDA, "configs/gpu.yaml")
    with pytest.raises(UsageError, match="no NVIDIA runtime.*nothing was started.*CONFIG=configs/cpu-smoke.yaml"):
        _preflight(t, "configs/gpu.yaml", {"Runtimes": {"runc": {}}})
    _preflight(t, "configs/gpu.yaml", {"Runtimes": {"runc": {}, "nvidia": {}}})


def test_preflight_stops_when_the_data_is_missing():
    t = parse(
        CUDA.replace("device: cuda", "device: cpu").replace(
            "dataset: synthetic", "dataset: imagefolder, data_dir: ./no/such/dir"
        ),
        "x.yaml",
    )
    with pytest.raises(UsageError, match="train.data_dir: ./no/such/dir is not a directory"):
        _preflight(t, "x.yaml", {"Runtimes": {}}, data_problem=dir_problem(data_path("./no/such/dir")))


def test_logs_status_down_follow_the_last_up(tmp_path, monkeypatch):
    monkeypatch.setattr(compose_verbs, "RUNS", tmp_path)
    monkeypatch.setattr(compose_verbs, "CURRENT", tmp_path / "current.json")
    smoke = compose_verbs.target("configs/cpu-smoke.yaml", 3)
    assert smoke.project.name == "cpu-smoke"
    assert smoke.project.file == str(tmp_path / "cpu-smoke" / "compose.yaml")
    assert compose_verbs.render_if_needed(smoke.topology, tmp_path / "cpu-smoke" / "compose.yaml") is True
    assert compose_verbs.render_if_needed(smoke.topology, tmp_path / "cpu-smoke" / "compose.yaml") is False
    compose_verbs._remember(smoke)
    last = compose_verbs.target(None, None)
    assert last.project == smoke.project and last.topology is None
    assert [s.name for s in compose_verbs._configured(last)] == ["ps", "worker1", "worker2", "worker3"]
    assert json.loads((tmp_path / "current.json").read_text())["config"] == "configs/cpu-smoke.yaml"
    # An explicit -c wins over the last `up`.
    assert compose_verbs.target("configs/default.yaml", None).project.name == "resnet18-imagenette"


RECORDED = Path(__file__).parent / "recorded"


def _recorded(name):
    return json.loads((RECORDED / name).read_text())


def _listed(configured, containers):
    return [
        (s.name, s.metrics_file, a["State"]["Status"] if a else None)
        for s, a in compose_status.status_services(configured, containers)
    ]


def test_status_lists_containers_beyond_the_configured_count():
    # `make up WORKERS=3`, then `make status CONFIG=configs/cpu-smoke.yaml` (2 workers configured).
    t = load("configs/cpu-smoke.yaml")
    assert _listed(services(t), _recorded("status-workers3.json")) == [
        ("ps", "ps.jsonl", "running"),
        ("worker1", "worker1.jsonl", "exited"),
        ("worker2", "worker2.jsonl", "restarting"),
        ("worker3", "worker3.jsonl", "running"),
    ]


def test_status_lists_configured_services_without_a_container():
    containers = [c for c in _recorded("status-workers3.json") if c["Name"] != "/cpu-smoke-worker1-1"]
    t = load("configs/cpu-smoke.yaml").with_workers(4)
    assert _listed(services(t), containers) == [
        ("ps", "ps.jsonl", "running"),
        ("worker1", "worker1.jsonl", None),
        ("worker2", "worker2.jsonl", "restarting"),
        ("worker3", "worker3.jsonl", "running"),
        ("worker4", "worker4.jsonl", None),
    ]
    assert _listed(services(t), []) == [(s.name, s.metrics_file, None) for s in services(t)]


def test_status_reads_a_ps_shards_metrics_under_its_rpc_name():
    ps = next(c for c in _recorded("status-workers3.json") if c["Name"] == "/cpu-smoke-ps-1")
    shard = copy.deepcopy(ps)
    shard["Name"] = "/cpu-smoke-ps-shard2-1"
    shard["Config"]["Labels"]["com.docker.compose.service"] = "ps-shard2"
    shard["Config"]["Env"].append("PSC_SHARD=2")
    assert _listed([], [shard, ps]) == [("ps", "ps.jsonl", "running"), ("ps-shard2", "ps2.jsonl", "running")]


def test_status_prefers_the_service_container_to_a_one_off_and_skips_foreign_ones():
    worker1 = next(c for c in _recorded("status-workers3.json") if c["Name"] == "/cpu-smoke-worker1-1")
    one_off = copy.deepcopy(worker1)
    one_off["Config"]["Labels"]["com.docker.compose.oneoff"] = "True"
    one_off["Created"] = "2026-11-23T15:00:00Z"
    one_off["State"]["Status"] = "running"
    scratch = {"Name": "/scratch", "State": {"Status": "created"}, "Config": {"Labels": {"ps-compose.scratch": "x"}}}
    assert _listed([], [worker1, one_off, scratch]) == [("worker1", "worker1.jsonl", "exited")]
    assert _listed([], [one_off]) == [("worker1", "worker1.jsonl", "running")]


def test_status_rows_from_recorded_containers():
    listed = compose_status.status_services(services(load("configs/cpu-smoke.yaml")), _recorded("status-workers3.json"))
    rows = [compose_status.service_row(s.name, a, {"ps.jsonl": PS_LINES}.get(s.metrics_file, [])) for s, a in listed]
    assert compose_status.format_status(rows)[1:] == [
        "ps         running (healthy)         -     220   0.1243   0.9666",
        "worker1    exited                    0       -        -        -",
        "worker2    restarting x2             1       -        -        -",
        "worker3    running                   -       -        -        -",
    ]


def test_status_shows_the_live_set_from_the_ps_records():
    from orchestrator.backends.compose.status import format_live, live_workers

    def rec(event, step, rank, workers, name=None):
        return json.dumps(
            {"time": step, "role": "ps", "rank": 0, "event": event, "step": step}
            | {"worker": name or f"worker{rank}", "worker_rank": rank, "workers": workers}
        )

    lines = [
        json.dumps({"time": 0, "role": "ps", "rank": 0, "event": "start", "step": 0}),
        rec("join", 0, 1, 1),
        rec("join", 3, 2, 2),
        rec("join", 400, 3, 3),
        rec("join", 410, 4, 4),
        rec("drop", 500, 2, 3),
        rec("join", 520, 2, 4, "worker2_r2"),
        rec("left", 812, 4, 3),
        "{torn",
    ]
    live = live_workers(lines)
    assert live == {"workers": ["worker1", "worker2_r2", "worker3"], "count": 3, "version": 812}
    assert format_live(live) == "live workers: 3 (worker1 worker2_r2 worker3), last change at version 812"
    assert format_live(live_workers([])) == "live workers: - (no worker joined yet)"


def test_scale_starts_the_missing_ranks_and_stops_the_highest_first():
    from orchestrator.backends.compose.verbs import scale_plan

    assert scale_plan({1: "worker1", 2: "worker2"}, 4) == (["worker3", "worker4"], [])
    assert scale_plan({1: "worker1", 2: "worker2", 3: "worker3", 4: "worker4"}, 2) == ([], ["worker4", "worker3"])
    assert scale_plan({1: "worker1", 3: "worker3"}, 3) == (["worker2"], [])  # a stopped rank comes back
    assert scale_plan({1: "worker1", 2: "worker2"}, 2) == ([], [])
