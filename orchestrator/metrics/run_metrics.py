"""The metrics of a run, read back: its records, and the figures a report shows.

Reads the JSON-lines metrics of a run (app/training/metrics.py, docs/design.md): every
`*.jsonl` in `<RUN_DIR>/metrics/` (a directory holding the files is taken as
is). From any file of the metrics directory:
- `eval` and `end` records with `accuracy` (the PS's, or worker1's for
  allreduce): held-out accuracy and loss; `samples` when the record has it,
  else estimated from the workers' `train` records (sum of their step counts,
  interpolated in time, times the batch size);
- workers' `train` records (`worker<k>.jsonl`): loss, samples/s, staleness;
- the PS's `end`: `staleness_hist` ({staleness: count}), `staleness_mean`,
  `staleness_max`; without them the workers' (sampled) staleness values.

A metrics file is appended to by every run of the same name: only each file's
last run is read (`records.last_segment`: it starts after an `end` followed by a
record more than GAP_SECONDS later, or at a `start` or a `join` at step 0 after
training had started), and files whose last run ended before the others' began
are left out.

Strategy, workers and batch size come from the `start` record every app
process writes first (strategy, batch_size, world_size, shards, model,
dataset, run_id, precision). Metrics written before the app wrote one are
read with `infer_info`. Time is wall time from the run's first `join` (the
PS's `Time:` counts from there too).
"""

from __future__ import annotations

import json
import math
from bisect import bisect_right
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from app.contract import NO_PS_STRATEGY, Event
from orchestrator.errors import UsageError
from orchestrator.metrics.records import Record, headline, is_event, last_segment, read_jsonl

THRESHOLD = 0.90

# --- reading --------------------------------------------------------------


def select_run(files: dict[str, list[Record]]) -> tuple[dict[str, list[Record]], int]:
    """Each file's last run; files from an earlier run (ended before the latest began) left out."""
    segments: dict[str, list[Record]] = {}
    dropped = 0
    for name, records in files.items():
        seg, n = last_segment(records)
        dropped += n
        if seg:
            segments[name] = seg
    if not segments:
        return {}, dropped
    latest = max(segments.values(), key=lambda s: s[-1]["time"])
    kept = {}
    for name, seg in segments.items():
        if seg[-1]["time"] >= latest[0]["time"]:
            kept[name] = seg
        else:
            dropped += len(seg)
    return kept, dropped


@dataclass
class Run:
    """One run's records (its last run only) and what is known about it."""

    path: Path  # the run directory
    metrics_dir: Path
    files: dict[str, list[Record]]  # file stem -> records, in file order
    strategy: Optional[str] = None
    workers: int = 0
    batch_size: Optional[int] = None
    batch_estimated: bool = False
    info_from: str = "metrics"  # where strategy, workers and batch size came from
    start: Optional[Record] = None  # the run's `start` record (None: metrics older than it)
    dropped: int = 0
    label: str = ""

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def worker_files(self) -> dict[str, list[Record]]:
        return {k: v for k, v in sorted(self.files.items(), key=lambda kv: rank_key(kv[0])) if k.startswith("worker")}

    def records(self, *events: Event) -> list[Record]:
        """Records of these events from every file, by time."""
        return sorted(
            (r for recs in self.files.values() for r in recs if is_event(r, *events)), key=lambda r: r["time"]
        )


def rank_key(stem: str) -> tuple[int, str]:
    digits = "".join(c for c in stem if c.isdigit())
    return (int(digits) if digits else 0, stem)


def metrics_dir_of(path: Path) -> tuple[Path, Path]:
    """(run directory, metrics directory) of a RUN_DIR argument."""
    if (path / "metrics").is_dir() and any((path / "metrics").glob("*.jsonl")):
        return path, path / "metrics"
    if any(path.glob("*.jsonl")):
        return (path.parent if path.name in ("metrics", "state-metrics") else path), path
    if (path / "state-metrics").is_dir():
        return path, path / "state-metrics"
    raise UsageError(
        f"{path}: no metrics here (expected {path}/metrics/*.jsonl); give the directory of a run, e.g. runs/cpu-smoke"
    )


def load_run(path: str | Path) -> Run:
    path = Path(path)
    if not path.is_dir():
        raise UsageError(f"{path}: no such directory (give the directory of a run, e.g. runs/cpu-smoke)")
    run_dir, mdir = metrics_dir_of(path)
    raw = {p.stem: read_jsonl(p) for p in sorted(mdir.glob("*.jsonl"))}
    files, dropped = select_run(raw)
    if not any(is_event(r, Event.TRAIN, Event.EVAL, Event.END) for recs in files.values() for r in recs):
        raise UsageError(f"{mdir}: no train, eval or end records yet")
    run = Run(run_dir, mdir, files, dropped=dropped)
    run.start = start_record(run)
    if run.start is not None:
        info_from_start(run, run.start)
    else:
        infer_info(run)
    return run


def start_record(run: Run) -> Optional[Record]:
    """The `start` record that describes the run: the PS's when it wrote one, else the first."""
    starts = run.records(Event.START)
    return next((r for r in starts if r.get("role") == "ps"), starts[0] if starts else None)


def info_from_start(run: Run, start: Record) -> None:
    """Strategy, workers and batch size as the app wrote them: workers are the ranks that
    wrote a start record as workers (else world_size - 1)."""
    worker_ranks = {r.get("rank") for r in run.records(Event.START) if r.get("role") == "worker"}
    run.strategy = start.get("strategy")
    run.workers = len(worker_ranks) or max(0, int(start.get("world_size") or 1) - 1)
    batch = start.get("batch_size")
    if batch:
        run.batch_size = int(batch)
    else:
        run.batch_size, run.batch_estimated = estimate_batch(run), True
    run.info_from = "start records"


def infer_info(run: Run) -> None:
    """For metrics without a `start` record (written by an older app): strategy, workers and
    batch size from the records that carry them > run.json (the orchestrator's own) > the
    files; the strategy stays unknown when none says it."""
    found: dict[str, Any] = {}
    sources = []
    for rec in run.records(Event.JOIN, Event.TRAIN, Event.EVAL, Event.END):
        for key in ("strategy", "batch_size"):
            if rec.get(key) is not None and key not in found:
                found[key] = rec[key]
    if found:
        sources.append("metrics")
    new = {k: v for k, v in _run_json(run.path).items() if v is not None and k not in found}
    if new:
        found.update(new)
        sources.append("run.json")
    workers = len([k for k, v in run.worker_files.items() if any(is_event(r, Event.TRAIN) for r in v)])
    run.workers = workers or int(found.get("workers") or 0)
    run.strategy = found.get("strategy")
    if found.get("batch_size"):
        run.batch_size = int(found["batch_size"])
    else:
        run.batch_size, run.batch_estimated = estimate_batch(run), True
    run.info_from = ", ".join(sources) or "metrics"


def _run_json(run_dir: Path) -> dict[str, Any]:
    try:
        doc = json.loads((run_dir / "run.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    train = (doc.get("topology") or {}).get("train") or {}
    workers = (doc.get("topology") or {}).get("workers") or {}
    return {
        "strategy": doc.get("strategy", train.get("strategy")),
        "batch_size": doc.get("batch_size", train.get("batch_size")),
        "workers": doc.get("workers", workers.get("count")),
    }


# --- figures from the records --------------------------------------------


def start_time(run: Run) -> float:
    """The run's first `join` (else its first record): 0 s on every time axis."""
    joins = run.records(Event.JOIN)
    if joins:
        return joins[0]["time"]
    return min(recs[0]["time"] for recs in run.files.values())


def worker_steps(run: Run) -> dict[str, tuple[list[float], list[float]]]:
    """Per worker: (times, step counts) of its join, train and end records."""
    out = {}
    for name, recs in run.worker_files.items():
        points = [
            (r["time"], float(r.get("step") or 0))
            for r in recs
            if is_event(r, Event.JOIN, Event.TRAIN, Event.END) and r.get("role", "worker") == "worker"
        ]
        if points:
            points.sort()
            out[name] = ([t for t, _ in points], [s for _, s in points])
    return out


def _interp(x: float, xs: list[float], ys: list[float]) -> float:
    if x < xs[0]:
        return 0.0
    if x >= xs[-1]:
        return ys[-1]
    i = bisect_right(xs, x)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)


class SamplesAt:
    """Training samples consumed by all workers at a time: batch x (sum of their steps)."""

    def __init__(self, run: Run) -> None:
        self.steps = worker_steps(run)
        self.batch = run.batch_size or 0

    def __call__(self, t: float) -> float:
        return self.batch * sum(_interp(t, xs, ys) for xs, ys in self.steps.values())


def estimate_batch(run: Run) -> Optional[int]:
    """The batch size the train records imply: samples/s x interval / steps in the interval."""
    samples = steps = 0.0
    for _name, recs in run.worker_files.items():
        prev: Optional[Record] = None
        for r in recs:
            if not is_event(r, Event.JOIN, Event.TRAIN):
                continue
            if (
                is_event(r, Event.TRAIN)
                and prev is not None
                and r.get("samples_per_s")
                and (r.get("step") or 0) > (prev.get("step") or 0)
            ):
                samples += r["samples_per_s"] * (r["time"] - prev["time"])
                steps += r["step"] - prev["step"]
            prev = r
    return max(1, round(samples / steps)) if steps else None


@dataclass
class Point:
    seconds: float
    samples: Optional[float]
    step: int
    value: float  # the headline metric's (accuracy, perplexity, the user's first)
    loss: Optional[float]
    metric: str = "accuracy"


def eval_points(run: Run) -> list[Point]:
    """The held-out headline metric (and loss) over the run: its eval and end records."""
    t0, samples_at = start_time(run), SamplesAt(run)
    points = []
    for r in run.records(Event.EVAL, Event.END):
        metric = headline(r)
        if not isinstance(r.get(metric), (int, float)):
            continue
        samples = r.get("samples")
        if samples is None and run.batch_size:
            samples = samples_at(r["time"])
        step = int(r.get("step") or 0)
        points.append(Point(r["time"] - t0, samples, step, float(r[metric]), r.get("loss"), metric))
    return points


def staleness_counts(run: Run) -> tuple[Counter, str]:
    """{staleness: count}: the PS's exact histogram, else the workers' sampled values."""
    for r in reversed(run.records(Event.END)):
        hist = r.get("staleness_hist")
        if isinstance(hist, dict) and hist:
            return Counter({int(k): int(v) for k, v in hist.items()}), "every push"
    values = [
        int(r["staleness"])
        for recs in run.worker_files.values()
        for r in recs
        if is_event(r, Event.TRAIN) and r.get("staleness") is not None
    ]
    return Counter(values), "sampled by workers"


def worker_rate(recs: list[Record]) -> Optional[float]:
    """A worker's samples/s over the run: each record's rate weighted by its interval."""
    samples = seconds = 0.0
    prev_t: Optional[float] = None
    for r in recs:
        if is_event(r, Event.JOIN):
            prev_t = r["time"]
        elif is_event(r, Event.TRAIN) and r.get("samples_per_s") is not None:
            if prev_t is not None and r["time"] > prev_t:
                samples += r["samples_per_s"] * (r["time"] - prev_t)
                seconds += r["time"] - prev_t
            prev_t = r["time"]
    if seconds > 0:
        return samples / seconds
    rates = [r["samples_per_s"] for r in recs if is_event(r, Event.TRAIN) and r.get("samples_per_s") is not None]
    return sum(rates) / len(rates) if rates else None


def total_samples(run: Run, end: Optional[Record], last: float) -> Optional[float]:
    """Training samples of the whole run: the end record's `samples`, else batch x every worker's steps."""
    if end is not None and end.get("samples") is not None:
        return float(end["samples"])
    return SamplesAt(run)(last) if run.batch_size else None


@dataclass
class Summary:
    label: str
    strategy: Optional[str]
    workers: int
    final_value: Optional[float]  # the headline metric's at the end (`metric`)
    final_loss: Optional[float]
    time_to: Optional[float]  # seconds to the threshold accuracy
    samples_to: Optional[float]  # samples to the threshold accuracy
    samples_per_s: Optional[float]  # all workers together: samples of the run / its training time
    staleness_mean: Optional[float]
    staleness_max: Optional[int]
    seconds: Optional[float]  # the run's training time (its end record), else its span
    threshold: float = THRESHOLD
    notes: list[str] = field(default_factory=list)
    metric: str = "accuracy"


def summarize(run: Run, threshold: float = THRESHOLD) -> Summary:
    points = eval_points(run)
    final = points[-1] if points else None
    # the threshold is an accuracy's: a run with another headline has no time to it
    reached = next((p for p in points if p.metric == "accuracy" and p.value >= threshold), None)
    rates = [x for x in (worker_rate(v) for v in run.worker_files.values()) if x is not None]
    end = next((r for r in reversed(run.records(Event.END)) if r.get(headline(r)) is not None), None)
    counts, _ = staleness_counts(run)
    s_mean: Optional[float] = None
    s_max: Optional[int] = None
    if end is not None and end.get("staleness_mean") is not None:
        s_mean, s_max = float(end["staleness_mean"]), end.get("staleness_max")
    elif counts:
        pushes = sum(counts.values())
        s_mean, s_max = sum(k * v for k, v in counts.items()) / pushes, max(counts)
    if run.strategy == NO_PS_STRATEGY:  # no PS: no staleness
        s_mean = s_max = None
    t0 = start_time(run)
    last = max(recs[-1]["time"] for recs in run.files.values())
    seconds = end["seconds"] if end is not None and end.get("seconds") is not None else last - t0
    total = total_samples(run, end, last)
    rate = total / seconds if total and seconds and seconds > 0 else (sum(rates) if rates else None)
    notes = []
    if run.dropped:
        notes.append(f"{run.dropped} records of earlier runs in {run.metrics_dir} left out")
    if end is None:
        notes.append("no end record: the run is unfinished or failed")
    if (
        run.batch_estimated
        and run.batch_size
        and not any(r.get("samples") is not None for r in run.records(Event.EVAL))
    ):
        notes.append(f"batch size {run.batch_size} estimated from the train records")
    return Summary(
        run.label or run.name,
        run.strategy,
        run.workers,
        final.value if final else None,
        final.loss if final else None,
        reached.seconds if reached else None,
        reached.samples if reached else None,
        rate,
        s_mean,
        s_max,
        seconds,
        threshold,
        notes,
        final.metric if final else "accuracy",
    )


def fmt(v: Any, spec: str, unit: str = "") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return format(v, spec) + unit


def format_summary(summaries: Sequence[Summary]) -> list[str]:
    """One line per run: strategy, workers, final accuracy, time and samples to the threshold,
    samples/s, staleness mean/max."""
    th = summaries[0].threshold if summaries else THRESHOLD
    width = max([len("RUN")] + [len(s.label) for s in summaries])
    metric = next((s.metric for s in summaries if s.metric != "accuracy"), "accuracy")
    final = "FINAL ACC" if metric == "accuracy" else f"FINAL {metric[:3].upper()}"
    lines = [
        f"{'RUN':<{width}}  {'STRATEGY':<9} {'WORKERS':>7} {final:>9} {f'TIME TO {th:.2f}':>12} "
        f"{f'SAMPLES TO {th:.2f}':>15} {'SAMPLES/S':>9} {'STALENESS MEAN/MAX':>18}"
    ]
    for s in summaries:
        stale = "-" if s.staleness_mean is None else f"{s.staleness_mean:.2f}/{fmt(s.staleness_max, 'd')}"
        lines.append(
            f"{s.label:<{width}}  {s.strategy or '?':<9} {s.workers:>7} {fmt(s.final_value, '.4f'):>9} "
            f"{fmt(s.time_to, '.1f', ' s'):>12} {fmt(s.samples_to, '.0f'):>15} "
            f"{fmt(s.samples_per_s, '.0f'):>9} {stale:>18}"
        )
    for s in summaries:
        lines.extend(f"  {s.label}: {n}" for n in s.notes)
    return lines
