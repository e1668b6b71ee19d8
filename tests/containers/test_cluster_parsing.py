"""status and smoke: the pure parts (metrics, states, verdicts). No engine needed."""

import copy
import io
import json
import tarfile
from pathlib import Path

import pytest

from orchestrator import paths
from orchestrator.backends import record, smoke
from orchestrator.backends import status as backend_status
from orchestrator.backends.base import Cluster, ServiceState
from orchestrator.backends.compose import doctor as compose_doctor
from orchestrator.backends.compose import status as compose_status
from orchestrator.backends.registry import get
from orchestrator.doctor.checks import run_checks
from orchestrator.doctor.facts import Facts, data_path, dir_problem
from orchestrator.doctor.report import stop_on_problems
from orchestrator.errors import UsageError
from orchestrator.metrics import records
from orchestrator.topology.model import load, parse
from orchestrator.topology.services import services
from orchestrator.verbs import cluster as verbs

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


state = compose_status.container_state


def test_summarize_metrics_keeps_the_last_values_and_skips_bad_lines():
    assert backend_status.summarize_metrics(WORKER_LINES) == {
        "step": 110,
        "loss": 0.0795,
        "metric": "accuracy",
        "value": None,
        "event": "end",
    }
    assert backend_status.summarize_metrics(PS_LINES) == {
        "step": 220,
        "loss": 0.1243,
        "metric": "accuracy",
        "value": 0.9666,
        "event": "end",
    }
    assert backend_status.summarize_metrics(["", "[1, 2]", "not json"])["step"] is None


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
        backend_status.service_row(state(attrs("ps", "running", health="healthy")), PS_LINES),
        backend_status.service_row(state(attrs("worker1", "exited", 0)), WORKER_LINES),
        backend_status.service_row(state(attrs("worker2", "restarting", 1, restarts=2)), []),
        backend_status.service_row(ServiceState("worker3", "no container"), []),
    ]
    assert backend_status.format_status(rows) == [
        "SERVICE    STATE                  EXIT    STEP     LOSS ACCURACY",
        "ps         running (healthy)         -     220   0.1243   0.9666",
        "worker1    exited                    0     110   0.0795        -",
        "worker2    restarting x2             1       -        -        -",
        "worker3    no container              -       -        -        -",
    ]


def test_a_run_whose_headline_is_another_metric_shows_it_in_status():
    lines = [
        json.dumps(
            {
                "time": 1.0,
                "event": "eval",
                "step": 100,
                "perplexity": 12.5,
                "loss": 2.53,
                "metrics": ["perplexity", "loss"],
            }
        ),
        json.dumps(
            {
                "time": 2.0,
                "event": "end",
                "step": 500,
                "perplexity": 8.6631,
                "loss": 2.159,
                "metrics": ["perplexity", "loss"],
            }
        ),
    ]
    rows = [backend_status.service_row(state(attrs("ps", "exited", 0)), lines)]
    assert backend_status.format_status(rows) == [
        "SERVICE    STATE                  EXIT    STEP     LOSS PERPLEXITY",
        "ps         exited                    0     500   2.1590     8.6631",
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


def _rec(t: float, event: str, step: int, **fields) -> dict:
    return {"time": t, "role": "ps", "rank": 0, "event": event, "step": step, **fields}


def test_course_tells_how_the_last_run_got_to_its_accuracy():
    """A failed smoke's accuracy line says how the run got there: the last run's evaluations,
    joins and drops with their update, its staleness and its pushes; an earlier run in the
    same file does not count."""
    earlier = [_rec(1, "start", 0, run_id="a"), _rec(2, "eval", 100, accuracy=0.5), _rec(3, "end", 200, accuracy=0.6)]
    last = [
        _rec(10, "start", 0, run_id="b"),
        _rec(11, "join", 0, worker="worker1", worker_rank=1),
        _rec(12, "join", 37, worker="worker2", worker_rank=2),
        _rec(13, "eval", 100, accuracy=0.91234),
        _rec(14, "drop", 150, worker="worker2", worker_rank=2, reason="silent"),
        _rec(15, "start", 150, run_id="b"),  # the PS restarted within run b: its records still count
        _rec(16, "resume", 150),
        _rec(17, "eval", 200, accuracy=0.8329),
        _rec(
            18, "end", 220, accuracy=0.8329, staleness_mean=1.2, staleness_max=9, pushes={"worker1": 150, "worker2": 70}
        ),
    ]
    assert records.course(earlier + last) == (
        "accuracy by update 100: 0.9123, 200: 0.8329; "
        "join worker1 at 0, join worker2 at 37, drop worker2 at 150, resume at 150; "
        "staleness mean 1.2, max 9; pushes worker1 150, worker2 70"
    )
    assert records.course([_rec(1, "eval", 100, accuracy=0.9)]) == "accuracy by update 100: 0.9000"  # no start: all
    assert records.course([]) == ""


def test_judge():
    ok = [compose_status.container_state(attrs(s, "exited")) for s in ("ps", "worker1", "worker2")]
    expected = ["ps", "worker1", "worker2"]
    assert smoke.judge(expected, ok, 0.95, 0.90) == []
    assert smoke.judge(expected, ok, 0.85, 0.90) == ["the PS's Accuracy 0.8500 < 0.90"]
    assert smoke.judge(expected, ok, None, 0.90) == ["the PS wrote no `end` record with its accuracy"]
    assert smoke.judge(expected, ok, 0.85, 0.90, course="accuracy by update 100: 0.9500") == [
        "the PS's Accuracy 0.8500 < 0.90 (accuracy by update 100: 0.9500)"
    ]
    assert smoke.judge(expected, ok, 0.95, 0.90, course="accuracy by update 100: 0.9500") == []
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
image: {base: pytorch/pytorch:2.14.1-cuda13.0-cudnn9-runtime, device: cuda}
train: {model: cnn, dataset: synthetic, batch_size: 8, lr: 0.1, epochs: 1}
workers: {count: 2}
"""


CPU_HINT = "CONFIG=configs/cpu-smoke.yaml runs anywhere: make up CONFIG=configs/cpu-smoke.yaml WORKERS=3"


def _preflight(t, config, info, **facts):
    """What `up` does first (cluster.preflight), on given facts instead of the host's."""
    f = Facts(
        info={"MemTotal": 2**36, **info},
        target={"compose": "docker compose (compose v2)"},
        gpus=[0, 1],
        disk_free=2**40,
        **facts,
    )
    stop_on_problems(
        run_checks(compose_doctor.CHECKS, t, f),
        config,
        "CONFIG=configs/cpu-smoke.yaml runs anywhere: make up CONFIG=configs/cpu-smoke.yaml WORKERS=3",
    )


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
    monkeypatch.setattr(paths, "RUNS", tmp_path)
    compose = get("compose")
    smoke = verbs.resolve(compose, "configs/cpu-smoke.yaml", 3)
    assert smoke.name == "cpu-smoke" and smoke.file == tmp_path / "cpu-smoke" / "compose.yaml"
    verbs.keep_document(compose, smoke)
    assert smoke.file.is_file()
    record.save(compose, smoke)
    last = verbs.resolve(compose, None, None)
    assert (last.name, last.file, last.topology) == (smoke.name, smoke.file, None)
    assert [s.name for s in verbs.configured(last)] == ["ps", "worker1", "worker2", "worker3"]
    assert json.loads((tmp_path / "current.json").read_text())["config"] == "configs/cpu-smoke.yaml"
    # An explicit -c wins over the last `up`.
    assert verbs.resolve(compose, "configs/default.yaml", None).name == "resnet18-imagenette"
    # A record an older version wrote is read too.
    old = {"project": "p", "compose_file": str(tmp_path / "p" / "compose.yaml"), "config": None}
    (tmp_path / "current.json").write_text(json.dumps(old))
    assert verbs.resolve(compose, None, None) == Cluster("p", tmp_path / "p" / "compose.yaml")


RECORDED = Path(__file__).parent / "recorded"


def _recorded(name):
    return json.loads((RECORDED / name).read_text())


def _listed(configured, containers):
    cluster = Cluster("p", Path("/nonexistent/compose.yaml"), topology=configured)
    found = compose_status.service_states(containers)
    return [
        (s.service, s.spec.metrics_file, None if s.status == "no container" else s.status)
        for s in verbs.listed(get("compose"), cluster, found)
    ]


def test_status_lists_containers_beyond_the_configured_count():
    # `make up WORKERS=3`, then `make status CONFIG=configs/cpu-smoke.yaml` (2 workers configured).
    t = load("configs/cpu-smoke.yaml")
    assert _listed(t, _recorded("status-workers3.json")) == [
        ("ps", "ps.jsonl", "running"),
        ("worker1", "worker1.jsonl", "exited"),
        ("worker2", "worker2.jsonl", "restarting"),
        ("worker3", "worker3.jsonl", "running"),
    ]


def test_status_lists_configured_services_without_a_container():
    containers = [c for c in _recorded("status-workers3.json") if c["Name"] != "/cpu-smoke-worker1-1"]
    t = load("configs/cpu-smoke.yaml").with_workers(4)
    assert _listed(t, containers) == [
        ("ps", "ps.jsonl", "running"),
        ("worker1", "worker1.jsonl", None),
        ("worker2", "worker2.jsonl", "restarting"),
        ("worker3", "worker3.jsonl", "running"),
        ("worker4", "worker4.jsonl", None),
    ]
    assert _listed(t, []) == [(s.name, s.metrics_file, None) for s in services(t)]


def test_status_reads_a_ps_shards_metrics_under_its_rpc_name():
    ps = next(c for c in _recorded("status-workers3.json") if c["Name"] == "/cpu-smoke-ps-1")
    shard = copy.deepcopy(ps)
    shard["Name"] = "/cpu-smoke-ps-shard2-1"
    shard["Config"]["Labels"]["com.docker.compose.service"] = "ps-shard2"
    shard["Config"]["Env"].append("PSC_SHARD=2")
    assert _listed(None, [shard, ps]) == [("ps", "ps.jsonl", "running"), ("ps-shard2", "ps2.jsonl", "running")]


def test_status_prefers_the_service_container_to_a_one_off_and_skips_foreign_ones():
    worker1 = next(c for c in _recorded("status-workers3.json") if c["Name"] == "/cpu-smoke-worker1-1")
    one_off = copy.deepcopy(worker1)
    one_off["Config"]["Labels"]["com.docker.compose.oneoff"] = "True"
    one_off["Created"] = "2026-11-23T15:00:00Z"
    one_off["State"]["Status"] = "running"
    scratch = {"Name": "/scratch", "State": {"Status": "created"}, "Config": {"Labels": {"ps-compose.scratch": "x"}}}
    assert _listed(None, [worker1, one_off, scratch]) == [("worker1", "worker1.jsonl", "exited")]
    assert _listed(None, [one_off]) == [("worker1", "worker1.jsonl", "running")]


def test_status_rows_from_recorded_containers():
    cluster = Cluster("p", Path("/nonexistent"), topology=load("configs/cpu-smoke.yaml"))
    listed = verbs.listed(get("compose"), cluster, compose_status.service_states(_recorded("status-workers3.json")))
    rows = [backend_status.service_row(s, {"ps.jsonl": PS_LINES}.get(s.spec.metrics_file, [])) for s in listed]
    assert backend_status.format_status(rows)[1:] == [
        "ps         running (healthy)         -     220   0.1243   0.9666",
        "worker1    exited                    0       -        -        -",
        "worker2    restarting x2             1       -        -        -",
        "worker3    running                   -       -        -        -",
    ]


def test_status_shows_the_live_set_from_the_ps_records():
    from orchestrator.backends.status import format_live, live_workers

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
    live = live_workers(lines)  # named as in the table
    assert live == {"workers": ["worker1", "worker2", "worker3"], "version": 812, "ended": False}
    assert format_live(live) == "live workers: 3 (worker1 worker2 worker3), last change at version 812"
    assert live_workers(lines, running={2, 4})["workers"] == ["worker2"]  # live: joined, and running now
    assert format_live(live_workers([])) == "live workers: - (no worker joined yet)"


def test_scale_starts_the_missing_ranks_and_stops_the_highest_first():
    from orchestrator.verbs.scaling import scale_plan

    assert scale_plan({1: "worker1", 2: "worker2"}, 4) == (["worker3", "worker4"], [])
    assert scale_plan({1: "worker1", 2: "worker2", 3: "worker3", 4: "worker4"}, 2) == ([], ["worker4", "worker3"])
    assert scale_plan({1: "worker1", 3: "worker3"}, 3) == (["worker2"], [])  # a stopped rank comes back
    assert scale_plan({1: "worker1", 2: "worker2"}, 2) == ([], [])
