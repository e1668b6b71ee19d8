"""`python -m bench cuda`: every process's command line is one the app accepts, the rows and
table from batch times (pure), and a tiny run of the plumbing on the CPU (slow)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.config import parse
from bench import cuda
from bench.__main__ import build_parser, main


def _args(*extra: str):
    return build_parser().parse_args(["cuda", *extra])


@pytest.mark.parametrize("case", cuda.CASES)
def test_every_process_of_every_case_is_a_command_line_the_app_accepts(case, tmp_path):
    precision, system, workers, exchange = case
    args = _args()
    for role, rank in [("ps", 0)] + [("worker", r) for r in range(1, workers + 1)]:
        argv = cuda.app_argv(role, rank, case, args, 29500, tmp_path)
        assert argv[1:3] == ["-m", "app"]
        config = parse(argv[3:], {})
        assert config.device == ("cuda" if role == "worker" else "cpu")
        assert config.world_size == workers + 1 and config.batch_size == 128
        assert config.strategy == ("sync" if system == "sync" else "async")
        assert config.overlap == (system == "overlap")
        assert config.exchange == exchange
        assert (config.precision, config.channels_last) == cuda.PRECISIONS[precision]
        assert config.max_steps == args.warmup + args.steps


def test_rows_count_every_workers_samples_and_the_table_divides_by_compute_alone():
    args = _args("--warmup", "1", "--batch", "100")
    alone = cuda.row(("fp32", "compute", 1, "-"), [[0.0, 0.1, 0.2, 0.3, 0.4]], args)
    two = cuda.row(("fp32", "overlap", 2, "auto"), [[0.0, 0.2, 0.4, 0.6], [0.0, 0.2, 0.4, 0.6]], args)
    assert alone["step_s"] == pytest.approx(0.1) and alone["samples_per_s"] == pytest.approx(1000)
    assert two["samples_per_s"] == pytest.approx(1000)  # two workers at 500 each
    line = next(t for t in cuda.table([alone, two]).splitlines() if "overlap, 2 workers" in t)
    assert line.split()[-4:] == ["0.2000", "2.00x", "1000", "1.00x"]


@pytest.mark.slow
def test_a_tiny_run_on_the_cpu_measures_compute_alone_and_the_app(tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["cuda", "--device", "cpu", "--batch", "4", "--image-size", "32", "--classes", "2", "--per-class", "12"]
    argv += ["--warmup", "2", "--steps", "4", "--only", "fp32-async-1-auto", "--out", str(out)]
    assert main(argv) == 0
    doc = json.loads(Path(out, "cuda.json").read_text())
    cases = [(r["precision"], r["system"], r["workers"], r["exchange"]) for r in doc["rows"]]
    assert cases == [("fp32", "compute", 1, "-"), ("bf16+cl", "compute", 1, "-"), ("fp32", "async", 1, "auto")]
    assert all(r["steps"] >= 1 and r["step_s"] > 0 for r in doc["rows"]) and doc["failures"] == []
    log = Path(out, "logs", "fp32-async-1-auto.worker1.log").read_text()
    assert "exchange with ps through shared memory" in log
    assert "fp32: async, 1 worker" in capsys.readouterr().out
