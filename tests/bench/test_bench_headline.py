"""`python -m bench`'s headline table, its JSON and `compare`: pure logic, no timing asserted.
The slow test runs a tiny headline end to end (every system, 2 steps) and checks its JSON."""

from __future__ import annotations

import json
import math

import pytest
import torch

from bench import headline, loop
from bench.__main__ import HEADLINE_TAIL_S, build_parser, headline_params, main


def raw(window: float, steps: int, compute: float = 0.1, comm: float = 0.05, workers: int = 2) -> dict:
    w = {"steps": steps, "window_s": window, "compute_s": compute, "comm_s": comm, "step_s": compute + comm}
    return {"workers": [dict(w, window_s=window * (1 + i / 10)) for i in range(workers)], "ps": {}}


def test_case_row_is_the_mean_over_workers_of_window_over_steps():
    row = headline.case_row("app", "resnet18-10", 2, raw(window=10.0, steps=20))
    assert row["per_worker_step_s"] == [pytest.approx(0.5), pytest.approx(0.55)]
    assert row["step_s"] == pytest.approx(0.525)
    assert row["steps"] == 20 and (row["compute_s"], row["comm_s"]) == (0.1, 0.05)


def _runs() -> list[dict]:
    rows = [
        headline.case_row(s, m, 2, raw(w, 10, workers=1))
        for m, s, w in [
            ("mnist-cnn", "app", 1.5),
            ("resnet18-10", "ref-uv", 5.0),
            ("resnet18-10", "app-sync", 3.0),
            ("resnet18-10", "compute", 2.0),
            ("resnet18-10", "app-sync", 4.0),
            ("resnet18-10", "app-sync", 3.5),
        ]
    ]
    return rows


def test_aggregate_orders_by_model_seen_then_system_and_divides_by_compute_only():
    rows = headline.aggregate(_runs())
    assert [(r["model"], r["system"]) for r in rows] == [
        ("mnist-cnn", "app"),
        ("resnet18-10", "compute"),
        ("resnet18-10", "app-sync"),
        ("resnet18-10", "ref-uv"),
    ]
    sync = rows[2]
    assert sync["repeats"] == 3 and sync["step_s"] == pytest.approx(0.35)  # the median of 0.3, 0.4, 0.35
    assert sync["step_s_range"] == [pytest.approx(0.3), pytest.approx(0.4)]
    assert sync["vs_compute"] == pytest.approx(0.35 / 0.2)
    assert rows[1]["vs_compute"] == pytest.approx(1.0)
    assert rows[0]["vs_compute"] is None  # no compute-only row for that model: no ratio
    assert sync["label"] == headline.LABELS["app-sync"]


def test_table_has_a_block_per_model_and_a_line_per_row():
    rows = headline.aggregate(_runs())
    text = headline.table(rows)
    assert text.count("2 workers") == 2
    for r in rows:
        assert r["label"] in text
    assert "1.75x" in text  # sync / compute only
    assert "(0.300-0.400)" in text  # the spread of the repeated row
    line = next(x for x in text.splitlines() if headline.LABELS["app"] in x)
    assert line.split()[-2] == "-"  # no compute-only row: no ratio


def _doc(rows: list[dict], kind: str = "headline") -> dict:
    doc = headline.document(rows, [], {"steps": None}, {"cores": 2}, [], 1.0)
    doc["kind"] = kind
    return json.loads(json.dumps(doc))  # what --json writes and compare reads back


def test_document_round_trips_through_json_with_schema_and_kind():
    doc = _doc(headline.aggregate(_runs()))
    assert doc["schema"] == headline.SCHEMA and doc["kind"] == "headline"
    assert {"machine", "settings", "wall_s", "rows", "runs", "failures"} <= set(doc)


def test_compare_pairs_common_rows_and_judges_lower_step_better():
    old = headline.aggregate(_runs())
    new = [dict(r, step_s=r["step_s"] * (0.5 if r["system"] == "app-sync" else 1.0)) for r in old[1:]]
    pairs = headline.compare(_doc(old), _doc(new))
    assert [p["system"] for p in pairs] == ["compute", "app-sync", "ref-uv"]  # mnist-cnn only in old
    sync = pairs[1]
    assert sync["ratio"] == pytest.approx(0.5) and sync["figure"] == "step_s"
    text = headline.compare_table(pairs)
    assert next(x for x in text.splitlines() if "app-sync" in x).endswith("better")
    assert next(x for x in text.splitlines() if "ref-uv" in x).rstrip().endswith("1.00x")


def test_compare_full_documents_judges_higher_updates_better_and_reads_unversioned_ones():
    old = {"rows": [{"model": "cnn", "workers": 1, "system": "app", "updates_per_s": 100.0}]}  # before SCHEMA
    new = {
        "schema": 1,
        "kind": "full",
        "rows": [{"model": "cnn", "workers": 1, "system": "app", "updates_per_s": 80.0}],
    }
    pairs = headline.compare(old, new)
    assert pairs[0]["ratio"] == pytest.approx(0.8)
    assert headline.compare_table(pairs).splitlines()[-1].endswith("worse")


def test_compare_refuses_mixed_kinds_and_newer_schemas():
    rows = headline.aggregate(_runs())
    with pytest.raises(ValueError, match="full and a headline"):
        headline.compare(_doc(rows), _doc(rows, kind="full"))
    newer = dict(_doc(rows), schema=headline.SCHEMA + 1)
    with pytest.raises(ValueError, match="schema"):
        headline.compare(newer, _doc(rows))
    assert headline.compare_table([]) == "no rows in common"


def test_compare_command_reads_files_and_bad_input_exits_2(tmp_path, capsys):
    rows = headline.aggregate(_runs())
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(_doc(rows)))
    b.write_text(json.dumps(_doc(rows)))
    assert main(["compare", str(a), str(b)]) == 0
    assert "app-sync" in capsys.readouterr().out
    b.write_text("{not json")
    assert main(["compare", str(a), str(b)]) == 2
    assert "b.json" in capsys.readouterr().err


def test_unknown_model_or_system_is_one_line_and_exit_2(capsys):
    assert main(["--models", "resnet50"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--models: 'resnet50'" in err and "resnet18-10" in err
    assert main(["--systems", "app,horovod"]) == 2
    assert "--systems: 'horovod'" in capsys.readouterr().err


def test_default_is_the_headline_and_full_keeps_the_matrix():
    parser = build_parser()
    args = parser.parse_args([])
    assert (args.command, args.models, args.workers) == ("headline", "resnet18-10,mnist-cnn", 2)
    assert args.systems.split(",") == list(headline.DEFAULT_SYSTEMS)
    assert "official" in args.systems and "ref" not in args.systems.split(",")  # the published file is the reference
    full = parser.parse_args(["full", "--quick"])
    assert (full.command, full.models, full.workers, full.quick) == ("full", "cnn,mnist-cnn,resnet18", "1,2", True)


def test_headline_params_one_thread_fixed_steps_and_no_tail_where_workers_wait():
    for system in headline.SYSTEMS:
        p = headline_params(system, "cnn", steps=7)
        assert p["threads"] == 1 and p["steps"] == 7
        assert p["tail"] == (HEADLINE_TAIL_S if system in ("app", "app-overlap") else 0.0)
    assert headline_params("app-sync", "cnn", None)["strategy"] == "sync"
    assert headline_params("app-overlap", "cnn", None)["overlap"] is True
    assert headline_params("ref-uv", "cnn", None)["transports"] == "uv"
    assert headline_params("ref", "cnn", None)["transports"] is None
    assert headline_params("allreduce", "cnn", None)["allreduce"] is True
    assert [s for s in headline.SYSTEMS if headline_params(s, "cnn", None)["workers_only"]] == [
        "compute",
        "allreduce",
    ]  # no PS process: it would only take a core's share


def test_run_steps_times_exactly_the_count_after_warmup():
    calls = []

    def step():
        calls.append(1)
        return 0.25, 0.5

    result = loop.run_steps(step, warmup=3, steps=5)
    assert result["steps"] == 5 and len(calls) == 8
    assert loop.run(step, {"steps": 2, "warmup": 0, "tail": 60.0}, lockstep=True)["steps"] == 2
    assert len(calls) == 10  # lockstep: no tail, not one step past the count


def test_reference_round_averages_the_pushed_grads_and_answers_the_round():
    from bench.reference import BatchUpdateParameterServer

    model = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    ps = BatchUpdateParameterServer(model, batch_update_size=2)
    for g in (torch.tensor([[2.0, 0.0]]), torch.tensor([[4.0, 2.0]])):  # what update_and_fetch_model does
        model.weight.grad += g
        ps.curr_update_size += 1
    fut = ps.future_model
    ps._update()
    assert fut.done() and fut.wait() is model
    assert model.weight.detach().tolist() == [[pytest.approx(1 - 0.01 * 3.0), pytest.approx(1 - 0.01 * 1.0)]]
    assert ps.curr_update_size == 0 and not ps.future_model.done()


@pytest.mark.slow
def test_a_tiny_headline_runs_every_system_to_its_count(tmp_path, capsys):
    """Every system ends: the ones whose workers wait for each other (sync, allreduce, the
    reference's rounds) must not wait for a step past the count."""
    out = tmp_path / "h.json"
    systems = ",".join(headline.SYSTEMS)  # the re-implemented example's rows too
    # a generous timeout: CI runs this beside container tests on 2 cores
    code = main(["--models", "cnn", "--systems", systems, "--steps", "2", "--timeout", "420", "--json", str(out)])
    if code != 0:  # the whole output: which system failed and why (an assertion's repr cuts it)
        captured = capsys.readouterr()
        pytest.fail(f"bench exit {code}\n{captured.out}\n{captured.err}", pytrace=False)
    doc = json.loads(out.read_text())
    # the published example runs ResNet-18 only: no row of it for cnn
    assert [r["system"] for r in doc["rows"]] == [s for s in headline.SYSTEMS if s != "official"]
    assert all(r["steps"] == 2 and r["step_s"] > 0 for r in doc["rows"])
    assert doc["machine"]["cores"] >= 1


@pytest.mark.slow
def test_headline_reference_row_is_the_published_example_run_as_published(tmp_path, capsys):
    out = tmp_path / "h.json"
    argv = ["--models", "resnet18-10", "--systems", "compute,official", "--steps", "6", "--timeout", "240"]
    assert main(argv + ["--json", str(out)]) == 0, capsys.readouterr()
    doc = json.loads(out.read_text())
    assert [r["system"] for r in doc["rows"]] == ["compute", "official"]
    official = doc["rows"][1]
    assert official["step_s"] > 0 and official["vs_compute"] > 0 and 1 <= official["steps"] <= 6
    assert official["compute_s"] is None  # the published example times whole steps only
    assert headline.LABELS["official"] in headline.table(headline.aggregate(doc["runs"]))


def test_constants_lines_follow_the_measures_order_and_skip_the_unmeasured():
    from bench import constants

    text = constants.lines({"gloo_s": 0.04, "state_mb": 44.8})
    assert [line.split()[0] for line in text.splitlines()] == ["state_mb", "gloo_s"]
    assert constants.MEASURES["gloo_s"] in text


def test_constants_time_the_apps_transport_both_ways_it_goes_and_torch_rpc_beside_it(tmp_path):
    from bench import constants, roundtrip
    from bench.procs import job_files

    assert set(roundtrip.WAYS.values()) == {"unix", "tcp", "tensorpipe"}
    for name in roundtrip.WAYS:
        assert {f"{name}_cpu_s", f"{name}_wall_s"} <= set(constants.MEASURES)
        assert {f"{name}_control_cpu_s", f"{name}_control_wall_s"} <= set(constants.MEASURES)
    files = job_files(tmp_path)
    unix = roundtrip._transport_config(0, "unix", files, 6100)
    assert unix.socket_dir == files["socket_dir"] and unix.secret_file == files["secret_file"]
    tcp = roundtrip._transport_config(1, "tcp", files, 6100)
    assert (tcp.socket_dir, tcp.encrypt, tcp.role, tcp.rank) == ("", True, "worker", 1)


@pytest.mark.slow
def test_constants_round_trip_runs_two_processes_per_way_and_reports_cpu_and_wall_of_each():
    from bench import roundtrip

    figures = roundtrip.round_trips(1000, repeats=2)
    kinds = ("cpu_s", "wall_s", "control_cpu_s", "control_wall_s")
    assert set(figures) == {f"{name}_{kind}" for name in roundtrip.WAYS for kind in kinds}
    assert all(math.isfinite(seconds) and seconds > 0 for seconds in figures.values()), figures


def test_constants_floor_is_a_memcpy_and_an_sgd_step_and_the_push_pull_is_set_against_it():
    from bench import constants

    got = constants.floor({"memcpy_s": 0.007, "sgd_s": 0.005, "app_pushpull_s": 0.036})
    assert got == {"floor_s": pytest.approx(0.012), "pushpull_vs_floor": pytest.approx(3.0)}
    assert constants.floor({"memcpy_s": 0.007, "sgd_s": 0.005}) == {"floor_s": pytest.approx(0.012)}
    assert constants.floor({"app_pushpull_s": 0.036}) == {}
    text = constants.lines({"pushpull_vs_floor": 3.0, "floor_s": 0.012, "app_pushpull_s": 0.036})
    assert [line.split()[0] for line in text.splitlines()] == ["app_pushpull_s", "floor_s", "pushpull_vs_floor"]


def test_constants_copy_timing_copies_the_state_and_the_gpu_copies_run_where_torch_sees_one():
    from bench import constants

    src, dst, synced = torch.randn(1000), torch.empty(1000), []
    assert constants.copy_seconds(dst, src, 3, lambda: synced.append(1)) >= 0
    assert torch.equal(dst, src) and len(synced) == 4  # one untimed call, then the 3 timed
    figures = constants.device_copies(1000, 2)
    expected = {f"{way}_{kind}_s" for way in ("h2d", "d2h") for kind in ("pageable", "pinned")}
    assert set(figures) == (expected if torch.cuda.is_available() else set())
    assert expected <= set(constants.MEASURES)


@pytest.mark.slow
def test_constants_push_pull_is_the_app_itself_less_its_compute():
    from bench import constants

    figures = constants.app_pushpull(timeout=240)
    assert set(figures) == {"app_pushpull_s"} and math.isfinite(figures["app_pushpull_s"])
