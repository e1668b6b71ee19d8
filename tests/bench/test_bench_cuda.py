"""`python -m bench cuda`: every process's command line is one the app accepts, the rows and
table from batch times (pure), and a tiny run of the plumbing on the CPU (slow)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.config import parse
from bench import cuda, cuda_trace
from bench.__main__ import build_parser, main


def _args(*extra: str):
    return build_parser().parse_args(["cuda", *extra])


def _app_args(argv: list[str]) -> list[str]:
    """The app's own arguments of a process's command line (a worker runs under bench.cuda_trace)."""
    if argv[1:3] == ["-m", "bench.cuda_trace"]:
        return argv[argv.index("--") + 1 :]
    assert argv[1:3] == ["-m", "app"]
    return argv[3:]


@pytest.mark.parametrize("case", cuda.CASES)
def test_every_process_of_every_case_is_a_command_line_the_app_accepts(case, tmp_path):
    precision, system, workers, exchange = case
    args = _args()
    roles = ([] if system == "allreduce" else [("ps", 0)]) + [("worker", r) for r in range(1, workers + 1)]
    for role, rank in roles:
        argv = cuda.app_argv(role, rank, case, args, 29500, tmp_path)
        config = parse(_app_args(argv), {})
        assert config.device == ("cuda" if role == "worker" else "cpu")
        assert config.world_size == workers + 1 and config.batch_size == 128
        assert config.strategy == {"sync": "sync", "allreduce": "allreduce"}.get(system, "async")
        assert config.overlap == system.startswith("overlap")
        assert config.cuda_graphs == system.endswith("+graphs")
        assert config.exchange == (exchange if system != "allreduce" else "auto")
        assert (config.precision, config.channels_last) == cuda.PRECISIONS[precision]
        assert config.max_steps == args.warmup + args.steps + args.profile_steps
        assert config.log_every == 6  # as a real run reports (every 10), often enough for 55 batches
        assert (config.secret_file, config.socket_dir) == (str(tmp_path / "secret"), str(tmp_path / "sockets"))
        if role == "worker":  # profiled after its timed batches
            assert argv[argv.index("--after") + 1] == str(args.warmup + args.steps)
            assert argv[argv.index("--steps") + 1] == str(args.profile_steps)


def test_both_strategies_are_measured_with_one_and_two_workers_on_the_gpu():
    systems = {(precision, system, workers) for precision, system, workers, _ in cuda.CASES}
    for precision in cuda.PRECISIONS:
        for system in ("overlap", "async", "sync", "allreduce"):
            assert {(precision, system, 1), (precision, system, 2)} <= systems


def test_every_case_with_cuda_graphs_is_measured_beside_the_same_case_without():
    graphed = [c for c in cuda.CASES if c[1].endswith("+graphs")]
    assert {(p, s) for p, s, _, _ in graphed} >= {("fp32", "async+graphs"), ("fp32", "overlap+graphs")}
    for precision, system, workers, exchange in graphed:
        assert (precision, system.removesuffix("+graphs"), workers, exchange) in cuda.CASES


def test_rows_count_every_workers_samples_and_the_table_divides_by_compute_alone():
    args = _args("--warmup", "1", "--batch", "100")
    alone = cuda.row(("fp32", "compute", 1, "-"), [[0.0, 0.1, 0.2, 0.3, 0.4]], args)
    measured = cuda.Measured([[0.0, 0.2, 0.4, 0.6], [0.0, 0.2, 0.4, 0.6]])
    measured.numbers, measured.gpu_idle = [[1, 2, 3, 4], [1, 2, 3, 4]], 0.125
    two = cuda.row(("fp32", "overlap", 2, "auto"), measured, args)
    assert alone["step_s"] == pytest.approx(0.1) and alone["samples_per_s"] == pytest.approx(1000)
    assert two["samples_per_s"] == pytest.approx(1000) and two["gpu_idle"] == 0.125  # two workers at 500 each
    assert alone["gpu_idle"] is None
    lines = cuda.table([alone, two]).splitlines()
    assert lines[0].split()[-2:] == ["GPU", "idle"]
    line = next(t for t in lines if "overlap, 2 workers" in t)
    assert line.split()[-5:] == ["0.2000", "2.00x", "1000", "1.00x", "12%"]
    assert next(t for t in lines if "compute alone" in t).split()[-1] == "-"


def test_a_workers_records_are_numbered_by_the_batches_it_had_done_across_epochs():
    train = [{"epoch": e, "batch": b} for e, b in [(1, 6), (1, 10), (2, 6), (2, 10), (3, 6), (3, 10), (4, 6)]]
    assert cuda.batches_done(train) == [6, 10, 16, 20, 26, 30, 36]
    assert cuda.batches_done([{"epoch": 1, "batch": 6}, {"epoch": 1, "batch": 12}]) == [6, 12]


def _trace(base_ns: int, span: tuple[float, float], kernels: list[tuple[float, float]]) -> dict:
    """A Chrome trace as torch.profiler writes it: the profiled span and GPU work, in µs from base."""
    events = [{"ph": "X", "cat": "user_annotation", "name": cuda_trace.SPAN, "ts": span[0], "dur": span[1] - span[0]}]
    events += [{"ph": "X", "cat": "kernel", "name": "k", "ts": s, "dur": e - s} for s, e in kernels]
    events += [{"ph": "X", "cat": "cpu_op", "name": "aten::add", "ts": span[0], "dur": 1.0}]
    return {"baseTimeNanoseconds": base_ns, "traceEvents": events}


def test_the_gpu_idle_share_is_the_span_less_the_union_of_every_workers_gpu_work():
    one = _trace(0, (100.0, 200.0), [(90.0, 110.0), (120.0, 150.0), (140.0, 160.0)])
    assert cuda_trace.idle_share([one]) == pytest.approx(1 - (10 + 40) / 100)  # clipped, overlaps counted once
    # a second worker, its clock base 50 µs later: its kernels 150..170 and 170..180 on the host's clock
    two = _trace(50_000, (45.0, 160.0), [(100.0, 120.0), (120.0, 130.0)])
    assert cuda_trace.idle_share([one, two]) == pytest.approx(1 - (10 + 40 + 20) / 100)
    assert cuda_trace.idle_share([_trace(0, (0.0, 10.0), [])]) is None  # a CPU run: no GPU work


@pytest.mark.slow
def test_a_tiny_run_on_the_cpu_measures_compute_alone_and_the_app(tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["cuda", "--device", "cpu", "--batch", "4", "--image-size", "32", "--classes", "2", "--per-class", "12"]
    argv += ["--warmup", "2", "--steps", "4", "--profile-steps", "2", "--out", str(out)]
    argv += ["--only", "fp32-async-1-auto", "fp32-allreduce-2--"]
    assert main(argv) == 0
    doc = json.loads(Path(out, "cuda.json").read_text())
    cases = [(r["precision"], r["system"], r["workers"], r["exchange"]) for r in doc["rows"]]
    assert cases == [
        ("fp32", "compute", 1, "-"),
        ("bf16+cl", "compute", 1, "-"),
        ("fp32", "async", 1, "auto"),
        ("fp32", "allreduce", 2, "-"),
    ]
    assert all(r["steps"] >= 1 and r["step_s"] > 0 for r in doc["rows"]) and doc["failures"] == []
    assert all(r["gpu_idle"] is None for r in doc["rows"])  # no GPU: the column says "-"
    log = Path(out, "logs", "fp32-async-1-auto.worker1.log").read_text()
    assert "exchange with ps through shared memory" in log
    printed = capsys.readouterr().out
    assert "fp32: async, 1 worker" in printed and "fp32: allreduce, 2 workers" in printed
