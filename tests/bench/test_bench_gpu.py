"""`python -m bench gpu`: the steady-state step from batch times, rows and table (pure), and a
tiny run end to end through the app as processes and the published example (slow)."""

from __future__ import annotations

import json

import pytest

from bench import gpu, gpu_report
from bench.__main__ import build_parser, main


def test_steady_step_is_the_window_where_every_worker_is_past_warmup_and_none_ended():
    a = [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]  # one batch a second
    b = [0.5, 2.5, 4.5, 6.5]  # one every two seconds, still going when `a` ends
    s = gpu_report.steady_step([a, b], warmup=1)
    # the window: from b's first batch (its warm-up, 0.5) to a's last (5.0)
    assert s["window_s"] == pytest.approx(4.5)
    assert s["per_worker_step_s"] == [pytest.approx(1.0), pytest.approx(2.0)]
    assert s["step_s"] == pytest.approx(1.5) and s["steps"] == 2 and s["batches"] == [6, 4]
    assert s["window"] == [0.5, 5.0]


def test_steady_step_of_workers_that_report_every_few_batches_counts_batches_not_reports():
    a = [10.0, 20.0, 30.0, 40.0]  # batches 10, 20, 30, 40: one a second
    b = [12.0, 22.0, 32.0, 42.0]  # batches 10, 15, 20, 25: one every two seconds
    s = gpu_report.steady_step([a, b], warmup=5, numbers=[[10, 20, 30, 40], [10, 15, 20, 25]])
    assert s["window"] == [12.0, 40.0]  # b's first report past its warm-up, a's last
    assert s["per_worker_step_s"] == [pytest.approx(1.0), pytest.approx(2.0)]
    assert s["steps"] == 10 and s["batches"] == [40, 25]
    with pytest.raises(ValueError, match="too few batches"):
        gpu_report.steady_step([a, [21.0]], warmup=5, numbers=[[10, 20, 30, 40], [10]])


def test_a_case_reports_eight_times_a_run_and_never_more_rarely_than_the_app_by_default():
    assert gpu.APP_LOG_EVERY == 10
    assert [gpu.log_every(b) for b in (45, 65, 200, 8, 3)] == [5, 8, 10, 1, 1]
    assert gpu.topology("overlap", 13, 2, 1, 45)["train"]["log_every"] == 5


def test_batch_times_reads_each_workers_train_records_and_their_batches():
    def lines(*records):
        return [json.dumps(r) for r in records] + [""]

    files = {
        "worker1.jsonl": lines({"event": "join", "time": 1.0}, {"event": "train", "time": 2.0, "batch": 10}),
        "worker2.jsonl": lines(
            {"event": "train", "time": 2.5, "batch": 10}, {"event": "train", "time": 3.5, "batch": 20}
        ),
    }
    assert gpu.batch_times(files, 2) == ([[2.0], [2.5, 3.5]], [[10], [10, 20]])


def test_steady_step_refuses_too_few_batches():
    with pytest.raises(ValueError, match="too few batches"):
        gpu_report.steady_step([[0.0, 1.0], [0.0, 1.0, 2.0, 3.0]], warmup=2)


def _run(system: str, step: float, where: str = "processes", c: int = 65, cpu: float | None = None) -> dict:
    return dict(compute_ms=c, workers=2, shards=1, where=where, system=system, step_s=step, steps=10, cpu_busy=cpu)


def test_aggregate_takes_medians_and_divides_by_compute_alone_and_by_processes():
    runs = [
        _run("sync", 0.3),
        _run("compute", 0.1),
        _run("sync", 0.2),
        _run("sync", 0.25),
        _run("sync", 0.5, "containers"),
    ]
    rows = gpu_report.aggregate(runs)
    assert [(r["system"], r["where"]) for r in rows] == [
        ("compute", "processes"),
        ("sync", "processes"),
        ("sync", "containers"),
    ]
    sync = rows[1]
    assert sync["step_s"] == pytest.approx(0.25) and sync["step_s_range"] == [0.2, 0.3] and sync["repeats"] == 3
    assert sync["vs_compute"] == pytest.approx(2.5) and sync["vs_processes"] is None
    assert rows[2]["vs_processes"] == pytest.approx(2.0)
    text = gpu_report.table(rows)
    assert "2.50x" in text and "0.200-0.300" in text and "ps-compose sync, 2 workers, containers" in text


def test_aggregate_takes_the_median_cpu_share_of_the_repeats_that_have_one():
    runs = [_run("compute", 0.1, cpu=0.5), _run("sync", 0.3, cpu=0.9), _run("sync", 0.2, cpu=0.7), _run("sync", 0.2)]
    rows = gpu_report.aggregate(runs)
    assert rows[0]["cpu_busy"] == pytest.approx(0.5) and rows[1]["cpu_busy"] == pytest.approx(0.8)
    assert gpu_report.aggregate([_run("sync", 0.2)])[0]["cpu_busy"] is None
    lines = gpu_report.table(rows).splitlines()
    assert " cpu " in lines[1]
    assert " 80% " in next(line for line in lines if "ps-compose sync" in line)


def test_cpu_per_step_divides_each_roles_seconds_by_the_steps_in_the_window():
    steady = {"window_s": 2.0, "per_worker_step_s": [0.02, 0.025]}  # 100 + 80 steps, each one push
    got = gpu_report.cpu_per_step({"worker": 1.8, "ps": 0.9}, steady)
    assert got == {"worker_cpu_ms": pytest.approx(10.0), "ps_cpu_ms": pytest.approx(5.0)}
    assert gpu_report.cpu_per_step({}, steady) == {"worker_cpu_ms": None, "ps_cpu_ms": None}  # compute alone


def test_the_table_shows_the_median_cpu_per_worker_step_and_per_push():
    runs = [
        _run("compute", 0.1),
        *(dict(_run("sync", 0.2), worker_cpu_ms=w, ps_cpu_ms=p) for w, p in [(9, 7), (11, 8)]),
    ]
    rows = gpu_report.aggregate(runs)
    assert (rows[1]["worker_cpu_ms"], rows[1]["ps_cpu_ms"]) == (pytest.approx(10.0), pytest.approx(7.5))
    lines = gpu_report.table(rows).splitlines()
    assert "wkr ms" in lines[1] and "ps ms" in lines[1]
    assert "  10.0    7.5 " in next(line for line in lines if "ps-compose sync" in line)
    assert "     -      - " in next(line for line in lines if "compute alone" in line)


def test_the_cores_floor_is_every_workers_step_and_push_of_cpu_spread_over_the_cores():
    run = dict(_run("sync", 0.03, c=13), worker_cpu_ms=10.0, ps_cpu_ms=8.0, cores=2)
    assert gpu_report.cores_floor_s(run) == pytest.approx(0.018)  # 2 workers x 18 ms on 2 cores
    assert gpu_report.cores_floor_s(dict(run, cores=16)) == pytest.approx(0.00225)  # a GPU host's cores
    assert gpu_report.cores_floor_s(dict(run, ps_cpu_ms=None)) is None
    assert gpu_report.cores_floor_s(_run("sync", 0.03)) is None  # no CPU figures, no cores: an older run
    rows = gpu_report.aggregate([_run("compute", 0.014, c=13), run, dict(run, worker_cpu_ms=12.0)])
    assert rows[1]["floor_s"] == pytest.approx(0.019)  # the median of 18 and 20 ms
    assert rows[1]["floor_vs_compute"] == pytest.approx(0.019 / 0.014)
    assert rows[0]["floor_s"] is None and rows[0]["floor_vs_compute"] is None
    lines = gpu_report.table(rows).splitlines()
    assert "cores x" in lines[1]
    assert "   1.36x " in next(line for line in lines if "ps-compose sync" in line)


def test_async_workers_that_do_not_wait_for_each_other_run_twice_the_timed_batches():
    assert gpu.batches_for("overlap", 2, 5, 40) == gpu.batches_for("async", 3, 5, 40) == 85
    assert gpu.batches_for("sync", 2, 5, 40) == gpu.batches_for("allreduce", 2, 5, 40) == 45  # in lockstep
    assert gpu.batches_for("async", 1, 5, 40) == gpu.batches_for("compute", 1, 5, 40) == 45
    # they report as often as the 45 batches of the window need, not as 85 would allow
    assert gpu.topology("overlap", 13, 2, 1, 85, every=gpu.log_every(45))["train"]["log_every"] == 5
    assert gpu.topology("overlap", 13, 2, 1, 85)["train"]["log_every"] == 10


def test_each_case_is_a_topology_of_the_sleep_model_as_the_users_code():
    t = gpu.topology("overlap", 30, 4, 2, 50)
    assert t["code"] == str(gpu.CODE) and (gpu.CODE / "sleep_resnet.py").is_file()
    assert t["train"]["model"] == "sleep_resnet:resnet18_30ms"
    assert (t["train"]["strategy"], t["train"]["overlap"], t["train"]["max_steps"]) == ("async", True, 50)
    assert t["ps"]["shards"] == 2 and t["workers"]["count"] == 4
    from orchestrator.topology.model import Topology

    Topology.model_validate(t)  # a valid topology, as the user would write it


def _cases(*argv: str) -> list[tuple[int, int, int, str, str]]:
    args = build_parser().parse_args(["gpu", *argv])
    gpu.resolve(args)
    return gpu.cases(args)


def test_the_default_run_is_a_current_gpus_compute_with_1_and_2_workers_and_2_in_containers():
    todo = _cases()
    assert {c for c, *_ in todo} == {13, 25}
    for c in (13, 25):
        assert (c, 1, 1, "processes", "compute") in todo
        for n in (1, 2):
            rows = [s for cc, nn, _, w, s in todo if (cc, nn, w) == (c, n, "processes") and s != "compute"]
            assert rows == ["async", "overlap", "sync"]
        assert [(n, s) for cc, n, _, w, s in todo if (cc, w) == (c, "containers")] == [(2, "overlap"), (2, "sync")]
    assert all(shards == 1 for _, _, shards, _, _ in todo)


def test_full_keeps_65_ms_4_workers_2_shards_and_every_row_in_containers():
    todo = _cases("--full")
    assert {c for c, *_ in todo} == {13, 25, 65} and {n for _, n, *_ in todo} == {1, 2, 4}
    sharded = {s for _, n, shards, w, s in todo if (n, shards, w) == (4, 2, "processes")}
    assert sharded == {"async", "overlap", "sync"}  # the PS strategies only: shards need a PS
    assert {s for *_, w, s in todo if w == "containers"} == {"async", "overlap", "sync", "allreduce"}
    assert {s for *_, w, s in todo if w == "processes"} >= {"allreduce", "official"}
    flags = _cases("--full", "--compute-ms", "130", "--workers", "2", "--containers", "")
    assert {(c, n) for c, n, *_ in flags} == {(130, 1), (130, 2)} and all(w == "processes" for *_, w, _ in flags)


@pytest.mark.slow
def test_a_tiny_gpu_bench_runs_the_app_and_the_official_example_and_writes_its_json(tmp_path):
    out = tmp_path / "gpu.json"
    # sync and the published example step in lockstep: their workers' windows always overlap, while
    # async workers this short may run their few batches apart (the bench's defaults take 60)
    argv = ["gpu", "--compute-ms", "5", "--workers", "2", "--systems", "sync,official", "--containers", ""]
    code = main(argv + ["--warmup", "2", "--steps", "6", "--timeout", "240", "--json", str(out)])
    assert code == 0
    doc = json.loads(out.read_text())
    assert doc["kind"] == "gpu" and doc["schema"] == gpu_report.SCHEMA and not doc["failures"]
    assert "loadavg_start" in doc["machine"] and "loadavg_end" in doc["machine"]
    assert [r["system"] for r in doc["rows"]] == ["compute", "sync", "official"]
    for row in doc["rows"]:
        assert row["step_s"] > 0 and row["compute_ms"] == 5 and row["vs_compute"] > 0
        assert row["cpu_busy"] is None or 0.0 <= row["cpu_busy"] <= 1.0  # None: a window under two samples
        if row["system"] == "sync" and row["cpu_busy"] is not None:  # the app's processes were seen
            assert row["worker_cpu_ms"] > 0 and row["ps_cpu_ms"] > 0
    for run in doc["runs"]:  # every worker finished every batch it was given, and they were timed
        expected = 1 if run["system"] == "compute" else 2
        assert run["batches"] == [8] * expected and run["steps"] >= 1


def test_compute_alone_runs_with_a_workers_threads_and_gives_the_bench_its_own_back(monkeypatch):
    import os

    import torch

    from app.config import parse
    from app.runtime import machine

    seen = []
    monkeypatch.setattr(gpu, "_compute_steps", lambda config, c, batches: seen.append(torch.get_num_threads()) or [])
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # the cores' share, as `python -m app` takes it
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(7)
        gpu.run_compute_alone(13, 3)
        after = torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
    one_worker_job = machine.sharing_cpus(parse(["worker", "--world_size", "2"], {}))
    assert seen == [max(1, len(os.sched_getaffinity(0)) // one_worker_job)]
    assert after == 7


def test_under_each_c_with_async_rows_the_floor_is_compute_alone_plus_the_ps_update_of_a_push():
    update = {"update_s": 0.008, "check_s": 0.002, "threads": 2, "pushes": 22}
    assert gpu_report.async_floor(0.025, 0.008) == pytest.approx(1.32)
    runs = [
        _run("compute", 0.025, c=25),
        _run("async", 0.04, c=25),
        _run("compute", 0.013, c=13),
        _run("sync", 0.03, c=13),
    ]
    text = gpu_report.table(gpu_report.aggregate(runs), update)
    blocks = {block.splitlines()[0].split(" ms ")[0]: block for block in text.split("\n\n")}
    floor = next(line for line in blocks["C = 25"].splitlines() if "floor of async" in line)
    assert "8.0 ms" in floor and "check of 2.0 ms" in floor and "2 threads" in floor and floor.endswith("1.32x")
    assert "floor of async" not in blocks["C = 13"]  # no async row there: sync's floor is another
    assert "floor of async" not in gpu_report.table(gpu_report.aggregate(runs))  # not measured


def test_the_ps_update_is_the_apps_own_with_a_ps_processs_threads_and_gives_the_bench_its_own_back(monkeypatch):
    import os

    import torch

    from app.config import parse
    from app.ps.state import State
    from app.runtime import machine
    from bench import ps_update

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # the cores' share, as `python -m app ps` takes it
    checks = []
    check = State.finite
    monkeypatch.setattr(State, "finite", lambda self, message: checks.append(1) or check(self, message))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(7)
        got = ps_update.measure(str(gpu.CODE), repeats=3)
        after = torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
    ps_process = machine.sharing_cpus(parse(["ps", "--world_size", "3"], {}))
    assert got["threads"] == max(1, len(os.sched_getaffinity(0)) // ps_process)
    assert got["pushes"] == 3 + 2  # every push timed (and the two before) was applied, none refused
    assert got["update_s"] > 0 and got["check_s"] > 0
    assert len(checks) == 3 + 2  # the check is timed on its own: a push its worker proved finite is not checked
    assert after == 7
