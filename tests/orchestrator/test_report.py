"""`report` (orchestrator/metrics/report.py) and `compare` (orchestrator/metrics/compare.py).

Fast tests write metrics files by hand in the format of app/training/metrics.py, with
known figures; the slow ones read the metrics of real runs (`local`, `compare`).
"""

from __future__ import annotations

import dataclasses
import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

import pytest
import yaml

from orchestrator.errors import UsageError
from orchestrator.metrics import compare, records, report, run_metrics
from orchestrator.topology.model import load

from orch_helpers import REPO, topology

T0 = 1_000_000.0
BATCH = 32


def rec(t: float, role: str, rank: int, event: str, step: int, **fields: Any) -> dict[str, Any]:
    return {"time": round(t, 3), "role": role, "rank": rank, "event": event, "step": step, **fields}


def ps_records(
    t0: float = T0,
    *,
    samples: bool = True,
    hist: bool = True,
    strategy: Optional[str] = "async",
    accuracies: tuple[float, ...] = (0.50, 0.91, 0.89),
    final: float = 0.96,
) -> list[dict]:
    """Two workers of 40 steps of 32 samples each over 4 s; an eval every second, `end` at 4 s."""
    out = [
        rec(t0, "ps", 0, "join", 0, worker="worker1", worker_rank=1, epoch=1, batch=0, pushes=0),
        rec(t0 + 0.1, "ps", 0, "join", 0, worker="worker2", worker_rank=2, epoch=1, batch=0, pushes=0),
    ]
    for i, acc in enumerate(accuracies, start=1):
        extra = {"samples": 2 * 10 * i * BATCH} if samples else {}
        out.append(rec(t0 + i, "ps", 0, "eval", 20 * i, accuracy=acc, loss=round(1 - acc, 4), **extra))
    end: dict[str, Any] = {
        "accuracy": final,
        "loss": round(1 - final, 4),
        "seconds": 4.0,
        "pushes": {"worker1": 40, "worker2": 40},
        "staleness_mean": 0.5,
        "staleness_max": 2,
    }
    if samples:
        end["samples"] = 2 * 40 * BATCH
    if strategy:
        end["strategy"] = strategy
    if hist:
        end["staleness_hist"] = {"0": 50, "1": 20, "2": 10}
    out.append(rec(t0 + 4, "ps", 0, "end", 80, **end))
    return out


def worker_records(rank: int, t0: float = T0, *, steps: int = 4, end: bool = True) -> list[dict]:
    """join, then a train record every second (10 batches of 32 at 320 samples/s), then end."""
    join_t = t0 + 0.1 * (rank - 1)
    out = [rec(join_t, "worker", rank, "join", 0, worker=f"worker{rank}", epoch=1, batch=0)]
    for i in range(1, steps + 1):
        out.append(
            rec(
                t0 + i,
                "worker",
                rank,
                "train",
                10 * i,
                epoch=1,
                batch=10 * i,
                loss=round(2.0 / i, 4),
                samples_per_s=320.0,
                staleness=i % 3,
            )
        )
    if end:
        out.append(rec(t0 + steps, "worker", rank, "end", 10 * steps, seconds=float(steps)))
    return out


def write(path: Path, records: list[dict], append: bool = False) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a" if append else "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def make_run(run_dir: Path, t0: float = T0, *, append: bool = False, workers: int = 2, **ps: Any) -> Path:
    m = run_dir / "metrics"
    write(m / "ps.jsonl", ps_records(t0, **ps), append)
    for k in range(1, workers + 1):
        write(m / f"worker{k}.jsonl", worker_records(k, t0), append)
    return run_dir


def read_png(path: Path):
    import matplotlib.image

    assert path.stat().st_size > 1000
    return matplotlib.image.imread(str(path))


# --- summary figures --------------------------------------------------------


def test_summary_of_known_records(tmp_path: Path) -> None:
    run = run_metrics.load_run(make_run(tmp_path / "r"))
    s = run_metrics.summarize(run)
    assert (run.strategy, run.workers, run.batch_size) == ("async", 2, 32)
    assert s.final_value == 0.96 and s.final_loss == pytest.approx(0.04)
    assert s.time_to == pytest.approx(2.0)  # the first eval at >= 0.90 (a later dip does not count)
    assert s.samples_to == 1280  # its `samples`
    assert s.samples_per_s == pytest.approx(2560 / 4.0)
    assert (s.staleness_mean, s.staleness_max) == (0.5, 2)
    assert s.notes == []
    lines = run_metrics.format_summary([s])
    assert lines[0].split()[:3] == ["RUN", "STRATEGY", "WORKERS"]
    assert lines[1].split() == ["r", "async", "2", "0.9600", "2.0", "s", "1280", "640", "0.50/2"]


def test_threshold_never_reached_and_other_threshold(tmp_path: Path) -> None:
    run = run_metrics.load_run(make_run(tmp_path / "r", accuracies=(0.5, 0.6), final=0.7))
    s = run_metrics.summarize(run)
    assert s.time_to is None and s.samples_to is None and s.final_value == 0.7
    assert "-" in run_metrics.format_summary([s])[1].split()
    assert run_metrics.summarize(run, threshold=0.55).time_to == pytest.approx(2.0)


def test_samples_estimated_from_train_records_without_samples_fields(tmp_path: Path) -> None:
    """No `samples` and no run.json: the batch size comes from samples/s x interval / steps."""
    run = run_metrics.load_run(make_run(tmp_path / "r", samples=False, strategy=None, hist=False))
    assert run.batch_size == 32 and run.batch_estimated
    assert run.strategy is None
    points = run_metrics.eval_points(run)
    # at t0+2 each worker has pushed 20 batches: 2 x 20 x 32
    assert [p.samples for p in points] == pytest.approx([640, 1280, 1920, 2560])
    s = run_metrics.summarize(run)
    assert s.samples_to == pytest.approx(1280) and s.samples_per_s == pytest.approx(640)
    assert any("estimated" in n for n in s.notes)
    # staleness from the workers' train records: i % 3 for i = 1..4, twice
    counts, source = run_metrics.staleness_counts(run)
    assert counts == {1: 4, 2: 2, 0: 2} and "sampled" in source
    assert (s.staleness_mean, s.staleness_max) == (0.5, 2)  # the PS's figures over every push win
    for r in run.files["ps"]:
        r.pop("staleness_mean", None)
    assert run_metrics.summarize(run).staleness_mean == pytest.approx(1.0)


def test_run_json_gives_strategy_and_batch(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path / "r", samples=False, strategy=None)
    (run_dir / "run.json").write_text(json.dumps({"strategy": "ssp", "workers": 2, "batch_size": 16}))
    run = run_metrics.load_run(run_dir)
    assert (run.strategy, run.batch_size, run.batch_estimated) == ("ssp", 16, False)
    assert run_metrics.eval_points(run)[1].samples == pytest.approx(2 * 20 * 16)


def test_the_compose_file_is_not_read_back(tmp_path: Path) -> None:
    """The app's records are the only input about a run: a compose.yaml beside old metrics
    (no `start` record) says nothing; the strategy stays unknown."""
    run_dir = make_run(tmp_path / "r", samples=False, strategy=None)
    env = {"PSC_STRATEGY": "sync", "PSC_BATCH_SIZE": "64"}
    (run_dir / "compose.yaml").write_text(yaml.safe_dump({"services": {"ps": {"environment": env}}}))
    run = run_metrics.load_run(run_dir)
    assert run.strategy is None and run.batch_size != 64 and "compose" not in run.info_from


def test_only_the_last_run_of_appended_files(tmp_path: Path) -> None:
    """Every run of a name appends to the same files: an earlier 3-worker run is left out."""
    make_run(tmp_path / "r", T0, workers=3, accuracies=(0.2, 0.3), final=0.4)
    make_run(tmp_path / "r", T0 + 100, append=True)
    run = run_metrics.load_run(tmp_path / "r")
    assert sorted(run.files) == ["ps", "worker1", "worker2"] and run.workers == 2
    assert all(r["time"] >= T0 + 100 for recs in run.files.values() for r in recs)
    s = run_metrics.summarize(run)
    assert s.final_value == 0.96 and s.time_to == pytest.approx(2.0)
    assert run.dropped == 3 * len(worker_records(1)) + len(ps_records(accuracies=(0.2, 0.3)))
    assert any("earlier runs" in n for n in s.notes)


def test_a_crashed_run_then_a_fresh_one(tmp_path: Path) -> None:
    """No `end` in the first run: a worker's `join` at step 0 after training starts the next one."""
    m = tmp_path / "r" / "metrics"
    write(m / "worker1.jsonl", worker_records(1, T0, steps=2, end=False))
    write(m / "worker1.jsonl", worker_records(1, T0 + 0.5), append=True)
    seg, dropped = records.last_segment(records.read_jsonl(m / "worker1.jsonl"))
    assert dropped == 3 and seg[0]["event"] == "join" and seg[0]["time"] == T0 + 0.5
    # a chaos-style rejoin (the worker resumes at its step count) stays in the same run
    rejoin = worker_records(1, T0, steps=2, end=False) + [rec(T0 + 9, "worker", 1, "join", 20)]
    assert records.last_segment(rejoin) == (rejoin, 0)


def test_bad_lines_are_skipped(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path / "r")
    with open(run_dir / "metrics" / "worker1.jsonl", "a") as f:
        f.write('{"time": 1000010.0, "role": "wor')  # killed mid-write
    assert run_metrics.summarize(run_metrics.load_run(run_dir)).final_value == 0.96


def test_allreduce_run_has_no_ps_file(tmp_path: Path) -> None:
    """allreduce: worker1.jsonl holds the eval and end records; no staleness; its `start`
    record (as every allreduce rank writes one) says the strategy."""
    m = tmp_path / "allreduce" / "metrics"
    start = {
        "time": T0 - 1,
        "role": "worker",
        "rank": 1,
        "event": "start",
        "step": 0,
        "strategy": "allreduce",
        "batch_size": 32,
        "world_size": 3,
        "workers": 2,
    }
    w1 = (
        [start]
        + worker_records(1)
        + [r for r in ps_records(strategy=None, hist=False) if r["event"] in ("eval", "end")]
    )
    for r in w1:
        r.pop("staleness", None)
        r.pop("staleness_mean", None)
        r.pop("staleness_max", None)
    write(m / "worker1.jsonl", sorted(w1, key=lambda r: r["time"]))
    write(m / "worker2.jsonl", [dict(start, rank=2)] + worker_records(2))
    run = run_metrics.load_run(tmp_path / "allreduce")
    assert run.strategy == "allreduce" and run.workers == 2
    s = run_metrics.summarize(run)
    assert s.final_value == 0.96 and s.time_to == pytest.approx(2.0)
    assert s.staleness_mean is None and s.staleness_max is None
    written = report.write_report([run], tmp_path / "out")
    assert not (tmp_path / "out" / "staleness.png").exists()
    assert {p.name for p in written} == {"loss.png", "accuracy.png", "throughput.png", "summary.txt"}


def test_no_metrics_is_a_usage_error(tmp_path: Path) -> None:
    (tmp_path / "empty" / "metrics").mkdir(parents=True)
    with pytest.raises(UsageError, match="no metrics"):
        run_metrics.load_run(tmp_path / "empty")
    with pytest.raises(UsageError, match="no such directory"):
        run_metrics.load_run(tmp_path / "missing")


# --- plots ------------------------------------------------------------------


def test_pngs_are_written_and_decodable(tmp_path: Path) -> None:
    run = run_metrics.load_run(make_run(tmp_path / "r"))
    written = report.write_report([run], tmp_path / "out")
    assert [p.name for p in written] == ["loss.png", "accuracy.png", "throughput.png", "staleness.png", "summary.txt"]
    for p in written[:-1]:
        image = read_png(p)
        assert image.ndim == 3 and image.shape[0] > 200 and image.shape[1] > 200
    assert "0.9600" in (tmp_path / "out" / "summary.txt").read_text()


def test_several_runs_on_one_plot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    figures: dict[str, Any] = {}
    real_save = report._save

    def keep(fig: Any, path: Path) -> Path:
        figures[path.name] = fig
        return real_save(fig, path)

    monkeypatch.setattr(report, "_save", keep)
    runs = [
        run_metrics.load_run(make_run(tmp_path / name, T0 + 50 * i, strategy=name))
        for i, name in enumerate(("async", "sync", "ssp"))
    ]
    report.write_report(runs, tmp_path / "out")

    def labels(name: str, panel: int) -> list[str]:
        return figures[name].axes[panel].get_legend_handles_labels()[1]

    for panel in (0, 1):  # against wall time, against samples
        assert labels("accuracy.png", panel)[:3] == ["async", "sync", "ssp"]
        assert labels("loss.png", panel) == ["async", "sync", "ssp"]
    assert labels("throughput.png", 0) == [f"{s} worker{k}" for s in ("async", "sync", "ssp") for k in (1, 2)]
    # sync has no staleness histogram
    assert [lb.split()[0] for lb in labels("staleness.png", 0)] == ["async", "ssp"]
    # the same time axis for each: seconds from the run's first join
    xs = figures["accuracy.png"].axes[0].lines[1].get_xdata()
    assert list(xs) == pytest.approx([1.0, 2.0, 3.0, 4.0])
    summary = (tmp_path / "out" / "summary.txt").read_text().splitlines()
    assert [line.split()[0] for line in summary[1:4]] == ["async", "sync", "ssp"]


def test_one_run_one_line_per_worker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    figures: dict[str, Any] = {}
    monkeypatch.setattr(report, "_save", lambda fig, path: figures.setdefault(path.name, fig) and path)
    report.write_report([run_metrics.load_run(make_run(tmp_path / "r"))], tmp_path / "out")
    assert figures["loss.png"].axes[0].get_legend_handles_labels()[1] == ["worker1", "worker2", "held-out"]
    assert figures["throughput.png"].axes[0].get_legend_handles_labels()[1] == ["worker1", "worker2"]


# --- command line and the last run -------------------------------------------


def test_cli_report(cli, tmp_path: Path) -> None:
    make_run(tmp_path / "runs" / "a")
    make_run(tmp_path / "runs" / "b", T0 + 50, strategy="sync")
    status, out, err = cli("report", "runs/a", "runs/b")
    assert status == 0, err
    assert "async" in out and "sync" in out and "report: wrote" in out
    assert read_png(tmp_path / "runs" / "report" / "accuracy.png").ndim == 3  # several runs: their parent's report/
    status, out, err = cli("report", "runs/a", "-o", "one")
    assert status == 0 and (tmp_path / "one" / "loss.png").is_file()
    status, _, err = cli("report", "runs/nope")
    assert status == 2 and "runs/nope: no such directory" in err


def test_last_run_picks_the_newer_metrics(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runs = tmp_path / "runs"
    run_dir = make_run(runs / "proj", T0)
    (runs / "current.json").write_text(json.dumps({"project": "proj", "compose_file": str(run_dir / "compose.yaml")}))

    def volume(newer: bool):
        def copy(project: str, dest: Path, out: Any) -> Optional[Path]:
            assert project == "proj"
            write(dest / "ps.jsonl", ps_records(T0 + (100 if newer else -100)))
            return dest

        return copy

    monkeypatch.setattr(report, "copy_volume_metrics", lambda project, dest, out: None)  # no engine
    assert report.last_run(runs) == run_dir / "metrics"
    monkeypatch.setattr(report, "copy_volume_metrics", volume(newer=True))
    assert report.last_run(runs) == run_dir / "state-metrics"
    monkeypatch.setattr(report, "copy_volume_metrics", volume(newer=False))
    assert report.last_run(runs) == run_dir / "metrics"
    run = run_metrics.load_run(run_dir / "state-metrics")
    assert run.path == run_dir  # compose.yaml and run.json are looked up next to it
    with pytest.raises(UsageError, match="current.json"):
        report.last_run(tmp_path / "elsewhere")


# --- compare ------------------------------------------------------------------


def test_topology_for_changes_only_strategy_epochs_eval_and_workers() -> None:
    base = load(REPO / "configs/cpu-smoke.yaml")
    t = compare.topology_for(base, "sync", workers=3, epochs=2, eval_every=5)
    assert (t.name, t.train.strategy, t.train.epochs, t.train.eval_every, t.workers.count) == ("sync", "sync", 2, 5, 3)
    assert dataclasses.replace(t.train, strategy="async", epochs=10, eval_every=100) == base.train
    assert t.image == base.image and t.ps == base.ps


def _summary(label: str, time_to: Optional[float], acc: float) -> run_metrics.Summary:
    return run_metrics.Summary(
        label, label, 2, acc, 0.1, time_to, None if time_to is None else 1280.0, 640.0, None, None, 4.0
    )


def test_compare_table() -> None:
    lines = compare.format_table(
        [
            compare.Outcome("async", Path("a"), 0, 13.2, _summary("async", 1.25, 0.9805)),
            compare.Outcome("sync", Path("s"), 0, 15.0, _summary("sync", None, 0.85)),
            compare.Outcome("allreduce", Path("r"), 1, 6.0),
        ]
    )
    assert lines[0].split()[:7] == ["STRATEGY", "TIME", "TO", "0.90", "FINAL", "ACC", "SAMPLES/S"]
    assert lines[1].split() == ["async", "1.2", "s", "0.9805", "640", "1280", "13s", "ok"]
    assert lines[2].split()[:3] == ["sync", "-", "0.8500"] and lines[2].endswith("ok, never reached 0.90")
    assert lines[3].split()[:4] == ["allreduce", "-", "-", "-"] and lines[3].endswith("failed (exit 1)")


def test_compare_runs_each_strategy_then_one_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """run_one faked: sync leaves metrics, allreduce fails; one report, the table, exit 1."""
    ran = []

    def fake_run_one(t, runs_dir: Path, *, source: str, verbose: bool, out) -> compare.Outcome:
        ran.append((t.train.strategy, t.workers.count, t.train.epochs))
        if t.train.strategy == "allreduce":
            (runs_dir / t.name).mkdir(parents=True)
            (runs_dir / t.name / "output.log").write_text("worker1 | boom\n")
            return compare.Outcome(t.name, runs_dir / t.name, 1, 2.0)
        make_run(runs_dir / t.name, strategy=t.train.strategy)
        return compare.Outcome(t.name, runs_dir / t.name, 0, 10.0)

    monkeypatch.setattr(compare, "run_one", fake_run_one)
    status = compare.run(
        ["sync", "allreduce"],
        workers=2,
        epochs=3,
        config=str(REPO / "configs/cpu-smoke.yaml"),
        runs_dir=str(tmp_path / "cmp"),
    )
    out = capsys.readouterr().out
    assert status == 1
    assert ran == [("sync", 2, 3), ("allreduce", 2, 3)]
    assert "| worker1 | boom" in out
    table = out[out.index("STRATEGY") :].splitlines()
    assert table[1].split()[:4] == ["sync", "2.0", "s", "0.9600"]
    assert table[2].startswith("allreduce") and table[2].endswith("failed (exit 1)")
    assert read_png(tmp_path / "cmp" / "report" / "accuracy.png").ndim == 3


def test_compare_entries_take_plus_options() -> None:
    base = load(REPO / "configs/cpu-smoke.yaml")
    assert compare.parse_entry("ssp+s2+slr") == ("ssp", {"staleness": 2, "staleness_lr": True})
    t = compare.topology_for(base, "async+bf16+overlap", workers=2, epochs=2, eval_every=5)
    assert (t.name, t.train.strategy, t.train.compress, t.train.overlap) == (
        "async-bf16-overlap",
        "async",
        "bf16",
        True,
    )
    with pytest.raises(ValueError, match="'zip'"):
        compare.parse_entry("async+zip")


def test_compare_refuses_an_option_the_strategy_cannot_take(cli) -> None:
    status, _, err = cli("compare", "--strategies", "sync+overlap", "-c", str(REPO / "configs/cpu-smoke.yaml"))
    assert status == 2 and "train.overlap" in err


def test_compare_rejects_unknown_strategies(cli) -> None:
    status, _, err = cli("compare", "--strategies", "async,bogus")
    assert status == 2 and "async, sync, ssp, allreduce" in err


# --- real runs ----------------------------------------------------------------


@pytest.mark.slow
def test_report_of_a_real_local_run(tmp_path: Path) -> None:
    doc = topology(name="rep", train={"epochs": 3, "eval_every": 20, "lr": 0.1})
    (tmp_path / "t.yaml").write_text(yaml.safe_dump(doc))
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrator", "local", "-c", "t.yaml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = run_metrics.load_run(tmp_path / "runs" / "rep")
    assert run.workers == 2 and run.strategy == "async" and run.batch_size
    s = run_metrics.summarize(run)
    points = run_metrics.eval_points(run)
    assert s.final_value is not None and s.final_value == points[-1].value
    assert all(p.samples is not None for p in points)
    assert [p.seconds for p in points] == sorted(p.seconds for p in points) and points[0].seconds >= 0
    reached = [p for p in points if p.value >= 0.90]
    assert s.time_to == (reached[0].seconds if reached else None)
    written = report.write_report([run], tmp_path / "out")
    for p in written[:-1]:
        assert read_png(p).ndim == 3


@pytest.mark.slow
def test_compare_async_for_real(cli, tmp_path: Path) -> None:
    status, out, err = cli(
        "compare", "--strategies", "async", "--epochs", "2", "-c", str(REPO / "configs/cpu-smoke.yaml"), "--runs", "cmp"
    )
    assert status == 0, out[-3000:] + err
    table = out[out.index("STRATEGY") :].splitlines()
    assert len(table) == 2 and table[1].split()[0] == "async" and " ok" in table[1]
    info = json.loads((tmp_path / "cmp" / "async" / "run.json").read_text())
    assert info["exit_code"] == 0 and info["strategy"] == "async" and info["topology"]["train"]["epochs"] == 2
    for name in ("loss.png", "accuracy.png", "throughput.png", "staleness.png"):
        assert read_png(tmp_path / "cmp" / "report" / name).ndim == 3
    s = run_metrics.summarize(run_metrics.load_run(tmp_path / "cmp" / "async"))
    assert s.final_value is not None and s.workers == 2
    assert f"{s.final_value:.4f}" in table[1].split()


def test_report_of_a_run_by_its_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(report, "RUNS", tmp_path / "runs")
    make_run(tmp_path / "runs" / "mine")
    said = io.StringIO()
    assert report.main([], tmp_path / "out", name="mine", out=said) == 0
    assert (tmp_path / "out" / "summary.txt").exists() and "runs/mine/metrics" in said.getvalue()
    with pytest.raises(UsageError, match="--name other: no run of that name here"):
        report.main([], name="other", out=said)
    with pytest.raises(UsageError, match="not both"):
        report.main([str(tmp_path / "runs" / "mine")], name="mine", out=said)
