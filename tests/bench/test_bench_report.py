"""bench/'s non-timing logic: rows, medians, goal ratios, verdicts, the table, metrics parsing.
No timing is asserted: the bench prints figures, it does not test them."""

from __future__ import annotations

import json

import pytest

from bench import loop, report
from bench.containers import throughput


def raw(
    steps: int,
    window: float,
    comm: float,
    compute: float,
    only: float | None,
    floats: int = 1000,
    workers: int = 1,
    idle: dict | None = None,
) -> dict:
    w = {
        "steps": steps,
        "window_s": window,
        "compute_s": compute,
        "comm_s": comm,
        "step_s": compute + comm,
        "compute_only_s": only,
        "push_bytes": 4 * floats,
        "pull_bytes": 4 * floats,
    }
    return {"workers": [dict(w) for _ in range(workers)], "ps": {}, "idle_cpu_percent": idle}


def test_case_row_sums_workers_and_counts_bytes_both_ways():
    row = report.case_row("app", "cnn", 2, 32, raw(100, 2.0, 0.004, 0.003, 0.003, floats=1000, workers=2))
    assert row["updates_per_s"] == pytest.approx(100.0)
    assert row["samples_per_s"] == pytest.approx(3200.0)
    assert row["bytes_per_update"] == 8000
    assert row["gb_per_s"] == pytest.approx(8000 * 100 / 1e9)


def test_wire_only_systems_have_no_samples():
    assert report.case_row("gloo", "cnn", 1, 32, raw(10, 1.0, 0.1, 0.0, None))["samples_per_s"] is None
    assert report.memcpy_row("cnn", 1, 1000, 0.001)["samples_per_s"] is None


def test_memcpy_row_copies_the_message_in_and_the_state_out():
    row = report.memcpy_row("resnet18", 2, 1_000_000, 0.002)
    assert row["bytes_per_update"] == 8_000_000
    assert row["gb_per_s"] == pytest.approx(4.0)
    assert row["updates_per_s"] == pytest.approx(500.0)


def test_aggregate_takes_medians_keeps_range_and_orders_rows():
    runs = [report.case_row("ref", "cnn", 1, 32, raw(s, 1.0, 0.01, 0.01, 0.01)) for s in (10, 30, 20)]
    runs += [report.case_row("app", "cnn", 1, 32, raw(s, 1.0, 0.001, 0.003, 0.003)) for s in (100, 300, 200)]
    runs += [report.case_row("app", "resnet18", 1, 32, raw(5, 1.0, 0.1, 0.1, 0.1))]
    rows = report.aggregate(runs)
    assert [(r["model"], r["system"]) for r in rows] == [("cnn", "app"), ("cnn", "ref"), ("resnet18", "app")]
    assert rows[0]["updates_per_s"] == pytest.approx(200.0)
    assert rows[0]["updates_per_s_range"] == [pytest.approx(100.0), pytest.approx(300.0)]
    assert rows[0]["repeats"] == 3


def test_aggregate_idle_cpu_is_a_median_per_role_and_skips_missing():
    runs = [
        report.case_row("app", "cnn", 1, 32, raw(10, 1.0, 0.01, 0.01, 0.01, idle=i))
        for i in ({"ps": 0.0, "worker": 2.0}, None, {"ps": 1.0, "worker": 4.0}, {"ps": 2.0, "worker": 3.0})
    ]
    assert report.aggregate(runs)[0]["idle_cpu_percent"] == {"ps": 1.0, "worker": 3.0}


def _rows() -> list[dict]:
    runs = [
        report.case_row("app", "cnn", 1, 32, raw(300, 1.0, 0.0005, 0.003, 0.003, idle={"ps": 0.0, "worker": 1.0})),
        report.case_row("app-overlap", "cnn", 1, 32, raw(300 / 1.17, 1.0, 0.0001, 0.003, 0.003)),
        report.case_row("ref", "cnn", 1, 32, raw(50, 1.0, 0.01, 0.01, 0.01, idle={"ps": 99.0, "worker": 98.0})),
        report.case_row("app-comm", "resnet18", 1, 32, raw(20, 1.0, 0.05, 0.0, 0.1)),
        report.case_row("gloo", "resnet18", 1, 32, raw(25, 1.0, 0.04, 0.0, None)),
        report.memcpy_row("resnet18", 1, 1000, 0.015),
    ]
    return report.aggregate(runs)


def test_ratios_per_goal_and_setting():
    rs = report.ratios(_rows())
    assert rs["app_vs_ref_updates"] == {"cnn/1": pytest.approx(6.0)}
    # the goal is judged on --overlap: per-worker step time from its update rate
    assert rs["comm_overhead"]["cnn/1"] == pytest.approx((1.17 / 300 - 0.003) / 0.003)
    assert rs["comm_overhead_no_overlap"]["cnn/1"] == pytest.approx(0.0005 / 0.003)
    assert rs["overlap_vs_app_updates"]["cnn/1"] == pytest.approx(1 / 1.17)
    assert rs["pushpull_vs_gloo"] == {"resnet18/1": pytest.approx(1.25)}
    assert rs["pushpull_vs_memcpy"] == {"resnet18/1": pytest.approx(0.05 / 0.015)}
    assert rs["idle_cpu_percent"]["ps"] == 0.0
    assert rs["idle_cpu_percent"]["ps (reference, for contrast)"] == 99.0


def test_verdicts_judge_the_app_only_and_say_when_unmeasured():
    rs = report.ratios(_rows())
    ok = report.verdicts(rs)
    assert ok["app_vs_ref_updates"] is True
    assert ok["pushpull_vs_gloo"] is False  # 1.25 > 1
    assert ok["pushpull_vs_memcpy"] is True
    assert ok["comm_overhead"] is False  # 0.30 > 0.15
    assert ok["idle_cpu_percent"] is True  # the reference's 99 % is contrast, not judged
    assert report.verdicts({name: {} for name in report.GOALS})["comm_overhead"] is None


def test_table_and_ratio_lines_name_every_row_and_goal():
    rows = _rows()
    text = report.table(rows)
    assert len(text.splitlines()) == 2 + len(rows)
    assert "reference PS" in text and "memcpy" in text
    lines = report.ratio_lines(report.ratios(rows))
    for name in report.GOALS:
        assert name in lines
    json.dumps({"rows": rows, "ratios": report.ratios(rows)})  # --json can write them


def test_run_window_reports_medians_of_the_steps_it_timed():
    calls = []

    def step():
        calls.append(1)
        return 0.25, 0.5

    result = loop.run_window(step, warmup=2, seconds=0.02, tail=0.0)
    assert result["steps"] >= 1 and len(calls) >= result["steps"] + 2
    assert (result["compute_s"], result["comm_s"]) == (0.25, 0.5)


def test_throughput_reads_the_ps_end_line_and_skips_bad_lines():
    lines = [
        '{"event": "eval", "step": 100, "accuracy": 0.9}',
        "not json",
        '{"event": "end", "step": 400, "seconds": 2.0, "accuracy": 0.97}',
        '{"event": "e',
    ]
    assert throughput(lines, 32) == {"updates": 400, "seconds": 2.0, "updates_per_s": 200.0, "samples_per_s": 6400.0}
    assert throughput(['{"event": "eval", "step": 1}'], 32) is None
