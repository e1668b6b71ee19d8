"""run_metrics reads a run's facts from the app's `start` records (strategy, batch size,
workers) and infers them only for metrics written before the app wrote one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from orchestrator.metrics import run_metrics

T0 = 2_000_000.0


def rec(t: float, role: str, rank: int, event: str, step: int, **fields: Any) -> dict[str, Any]:
    return {"time": round(t, 3), "role": role, "rank": rank, "event": event, "step": step, **fields}


def start(t: float, role: str, rank: int, **over: Any) -> dict[str, Any]:
    fields = {
        "strategy": "ssp",
        "batch_size": 48,
        "world_size": 4,
        "shards": 1,
        "model": "cnn",
        "dataset": "digits",
        "run_id": "r-1",
        "precision": "fp32",
        **over,
    }
    return rec(t, role, rank, "start", 0, **fields)


def worker(rank: int, *, with_start: bool = True, rate: float = 1000.0) -> list[dict[str, Any]]:
    """A worker of 30 steps over 3 s; its samples/s (`rate`) implies a batch of rate / 10."""
    out = [start(T0, "worker", rank)] if with_start else []
    out.append(rec(T0 + 0.1, "worker", rank, "join", 0, worker=f"worker{rank}", epoch=1))
    out += [
        rec(T0 + 0.1 + i, "worker", rank, "train", 10 * i, epoch=1, loss=1.0 / i, samples_per_s=rate)
        for i in range(1, 4)
    ]
    return out


def ps(*, with_start: bool = True) -> list[dict[str, Any]]:
    out = [start(T0 - 0.5, "ps", 0)] if with_start else []
    out += [
        rec(T0 + 0.1, "ps", 0, "join", 0, worker="worker1"),
        rec(T0 + 3.5, "ps", 0, "end", 90, accuracy=0.93, loss=0.2, seconds=3.4),
    ]
    return out


def write_run(run_dir: Path, files: dict[str, list[dict[str, Any]]]) -> Path:
    (run_dir / "metrics").mkdir(parents=True)
    for name, records in files.items():
        (run_dir / "metrics" / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run_dir


def test_the_start_record_gives_strategy_batch_and_workers(tmp_path: Path) -> None:
    # The train records imply a batch of 100 (1000 samples/s, 10 steps a second): the start record wins.
    run = run_metrics.load_run(
        write_run(tmp_path / "run", {"ps": ps(), "worker1": worker(1), "worker2": worker(2), "worker3": worker(3)})
    )
    assert (run.strategy, run.batch_size, run.workers) == ("ssp", 48, 3)
    assert not run.batch_estimated and run.info_from == "start records"
    assert run.start is not None and run.start["role"] == "ps" and run.start["run_id"] == "r-1"
    summary = run_metrics.summarize(run)
    assert summary.strategy == "ssp" and summary.workers == 3 and summary.final_value == 0.93


def test_workers_from_world_size_when_only_the_ps_wrote_one(tmp_path: Path) -> None:
    run = run_metrics.load_run(
        write_run(
            tmp_path / "run",
            {"ps": ps(), "worker1": worker(1, with_start=False), "worker2": worker(2, with_start=False)},
        )
    )
    assert (run.strategy, run.batch_size, run.workers) == ("ssp", 48, 3)  # world_size 4: 3 workers


def test_allreduce_start_record_without_a_ps(tmp_path: Path) -> None:
    files = {
        f"worker{k}": [start(T0, "worker", k, strategy="allreduce", world_size=3)] + worker(k, with_start=False)
        for k in (1, 2)
    }
    files["worker1"].append(rec(T0 + 3.5, "worker", 1, "end", 30, accuracy=0.91, seconds=3.4))
    run = run_metrics.load_run(write_run(tmp_path / "run", files))
    assert (run.strategy, run.workers, run.batch_size) == ("allreduce", 2, 48)
    assert run_metrics.summarize(run).staleness_mean is None


def test_old_metrics_without_a_start_record_are_inferred(tmp_path: Path) -> None:
    run = run_metrics.load_run(
        write_run(
            tmp_path / "run",
            {
                "ps": ps(with_start=False),
                "worker1": worker(1, with_start=False),
                "worker2": worker(2, with_start=False),
            },
        )
    )
    assert run.start is None and run.batch_estimated
    assert (run.batch_size, run.workers, run.strategy) == (100, 2, None)


def test_a_new_run_begins_at_its_start_record(tmp_path: Path) -> None:
    """A file appended to by a crashed run and a fresh one: only the fresh run is read,
    its start record included."""
    crashed = [start(T0 - 100, "worker", 1, batch_size=16)] + [
        rec(T0 - 99 + i, "worker", 1, "train", 10 * i, samples_per_s=160.0) for i in range(1, 3)
    ]
    run = run_metrics.load_run(write_run(tmp_path / "run", {"ps": ps(), "worker1": crashed + worker(1)}))
    assert run.files["worker1"][0]["event"] == "start" and run.files["worker1"][0]["batch_size"] == 48
    assert run.dropped == 3 and run.batch_size == 48
