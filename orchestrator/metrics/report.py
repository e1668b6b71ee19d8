"""`python -m orchestrator report [RUN_DIR ...]`: PNG plots and a summary of runs.

The records and figures come from orchestrator/metrics/run_metrics.py. With no
RUN_DIR: the cluster `up` started last (runs/current.json), its metrics copied
from the project's state volume into `runs/<name>/state-metrics/` (Docker), or
`runs/<name>/metrics/` from `orchestrator local`, whichever holds the newer
records. Plots use matplotlib's Figure API (Agg, no display needed).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Optional, TextIO

from app.contract import Event
from orchestrator.errors import UsageError
from orchestrator.metrics.records import is_event, read_jsonl
from orchestrator.metrics.run_metrics import (
    THRESHOLD,
    Run,
    SamplesAt,
    eval_points,
    format_summary,
    load_run,
    rank_key,
    staleness_counts,
    start_time,
    summarize,
    worker_rate,
)
from orchestrator.paths import RUNS

STALENESS_STRATEGIES = ("async", "ssp")
SMOOTH = 5  # records in the trailing mean of the samples/s lines
PLOTS = ("loss.png", "accuracy.png", "throughput.png", "staleness.png")


# --- plots ----------------------------------------------------------------


def _figure(title: str, panels: int = 2):
    from matplotlib.figure import Figure  # the Agg canvas, no pyplot, no display

    fig = Figure(figsize=(6.0 * panels, 4.2), layout="constrained")
    axes = fig.subplots(1, panels, squeeze=False)[0]
    fig.suptitle(title)
    return fig, list(axes)


def _save(fig: Any, path: Path) -> Path:
    fig.savefig(path, dpi=100, format="png")
    return path


def _labels(runs: Sequence[Run]) -> None:
    """Each run's legend name: its strategy when that names runs uniquely, else its directory."""
    strategies = [r.strategy for r in runs]
    unique = None not in strategies and len(set(strategies)) == len(runs)
    for r in runs:
        r.label = r.label or (
            str(r.strategy)
            if unique and len(runs) > 1
            else (r.name if r.strategy in (None, r.name) else f"{r.name} ({r.strategy})")
        )


def plot_loss(runs: Sequence[Run], out: Path) -> Path:
    fig, (ax_t, ax_s) = _figure(
        "Loss" + (": training loss per worker, held-out loss" if len(runs) == 1 else ": held-out loss per run")
    )
    for run in runs:
        t0, samples_at = start_time(run), SamplesAt(run)
        if len(runs) == 1:
            for name, recs in run.worker_files.items():
                train = [r for r in recs if is_event(r, Event.TRAIN) and r.get("loss") is not None]
                if train:
                    ax_t.plot([r["time"] - t0 for r in train], [r["loss"] for r in train], lw=1, label=name)
                    if run.batch_size:
                        ax_s.plot([samples_at(r["time"]) for r in train], [r["loss"] for r in train], lw=1, label=name)
        points = [p for p in eval_points(run) if p.loss is not None]
        label = "held-out" if len(runs) == 1 else run.label
        style = dict(color="black", lw=2) if len(runs) == 1 else dict(lw=1.5)
        if points:
            ax_t.plot([p.seconds for p in points], [p.loss for p in points], marker="o", ms=3, label=label, **style)
            with_samples = [p for p in points if p.samples is not None]
            ax_s.plot(
                [p.samples for p in with_samples],
                [p.loss for p in with_samples],
                marker="o",
                ms=3,
                label=label,
                **style,
            )
    _axes(ax_t, "wall time (s)", "loss")
    _axes(ax_s, "training samples (all workers)", "loss")
    return _save(fig, out / "loss.png")


def plot_accuracy(runs: Sequence[Run], out: Path, threshold: float = THRESHOLD) -> Path:
    """The held-out headline metric over time and samples: accuracy.png, or `<metric>.png` for
    runs whose headline is another (perplexity, the user's)."""
    metric = next((p.metric for run in runs for p in eval_points(run) if p.metric != "accuracy"), "accuracy")
    fig, (ax_t, ax_s) = _figure(f"Held-out {metric}")
    for run in runs:
        points = eval_points(run)
        if not points:
            continue
        label = run.label if len(runs) > 1 else "held-out"
        ax_t.plot([p.seconds for p in points], [p.value for p in points], marker="o", ms=3, label=label)
        with_samples = [p for p in points if p.samples is not None]
        ax_s.plot([p.samples for p in with_samples], [p.value for p in with_samples], marker="o", ms=3, label=label)
    for ax in (ax_t, ax_s) if metric == "accuracy" else ():  # the threshold is an accuracy's
        ax.axhline(threshold, color="grey", ls="--", lw=1, label=f"{threshold:.2f}")
    _axes(ax_t, "wall time (s)", metric)
    _axes(ax_s, "training samples (all workers)", metric)
    return _save(fig, out / f"{metric}.png")


def _smooth(values: list[float], window: int = SMOOTH) -> list[float]:
    """Trailing mean over `window` values (a worker's rate between two records is noisy)."""
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v - (values[i - window] if i >= window else 0.0)
        out.append(acc / min(i + 1, window))
    return out


def plot_throughput(runs: Sequence[Run], out: Path) -> Path:
    fig, (ax, ax_bar) = _figure(f"Samples/s per worker (left: mean of {SMOOTH} records; right: over the run)")
    bars: list[tuple[str, str, float]] = []
    for run in runs:
        t0 = start_time(run)
        for name, recs in run.worker_files.items():
            train = [r for r in recs if is_event(r, Event.TRAIN) and r.get("samples_per_s") is not None]
            if train:
                label = name if len(runs) == 1 else f"{run.label} {name}"
                ax.plot(
                    [r["time"] - t0 for r in train], _smooth([r["samples_per_s"] for r in train]), lw=1, label=label
                )
            rate = worker_rate(recs)
            if rate is not None:
                bars.append((run.label or run.name, name, rate))
    _axes(ax, "wall time (s)", "samples/s")
    workers = sorted({w for _, w, _ in bars}, key=rank_key)
    groups = list(dict.fromkeys(g for g, _, _ in bars))
    width = 0.8 / max(len(workers), 1)
    for j, w in enumerate(workers):
        xs = [i - 0.4 + width * (j + 0.5) for i, g in enumerate(groups) for g2, w2, _ in bars if g2 == g and w2 == w]
        ys = [v for g in groups for g2, w2, v in bars if g2 == g and w2 == w]
        ax_bar.bar(xs, ys, width=width, label=w)
    ax_bar.set_xticks(range(len(groups)), groups)
    _axes(ax_bar, "run" if len(runs) > 1 else "", "samples/s")
    return _save(fig, out / "throughput.png")


def plot_staleness(runs: Sequence[Run], out: Path) -> Optional[Path]:
    """Histograms of the staleness of pushes, for the async and ssp runs (None: no such run)."""
    shown = [
        (run, *staleness_counts(run))
        for run in runs
        if run.strategy in STALENESS_STRATEGIES or (run.strategy is None and "ps" in run.files)
    ]
    shown = [(run, c, src) for run, c, src in shown if c]
    if not shown:
        return None
    fig, (ax,) = _figure("Staleness of pushes (PS versions behind)", panels=1)
    width = 0.8 / len(shown)
    for i, (run, counts, source) in enumerate(shown):
        total = sum(counts.values())
        xs = sorted(counts)
        ax.bar(
            [x - 0.4 + width * (i + 0.5) for x in xs],
            [counts[x] / total for x in xs],
            width=width,
            label=f"{run.label if len(runs) > 1 else run.name} ({source})",
        )
    _axes(ax, "staleness", "fraction of pushes")
    return _save(fig, out / "staleness.png")


def _axes(ax: Any, xlabel: str, ylabel: str) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")


def require_matplotlib() -> None:
    """The plots' one optional dependency, or one line saying how to install it."""
    if importlib.util.find_spec("matplotlib") is None:
        raise UsageError(
            "the report's plots need matplotlib, which is not installed here: pip install 'ps-compose[report]'"
        )


def write_report(runs: Sequence[Run], out: Path, threshold: float = THRESHOLD) -> list[Path]:
    """The PNGs and summary.txt in `out`; the paths written."""
    require_matplotlib()
    _labels(runs)
    try:
        out.mkdir(parents=True, exist_ok=True)
        for stale in PLOTS:  # a plot this report does not draw must not survive from an earlier one
            (out / stale).unlink(missing_ok=True)
    except OSError as e:
        raise UsageError(f"{out}: cannot write: {e.strerror or e}") from None
    written = [plot_loss(runs, out), plot_accuracy(runs, out, threshold), plot_throughput(runs, out)]
    staleness = plot_staleness(runs, out)
    if staleness is not None:
        written.append(staleness)
    text = "\n".join(format_summary([summarize(r, threshold) for r in runs])) + "\n"
    (out / "summary.txt").write_text(text, encoding="utf-8")
    written.append(out / "summary.txt")
    return written


# --- the last run ---------------------------------------------------------


def last_run(runs_dir: Path = RUNS, out: Optional[TextIO] = None) -> Path:
    """The metrics of the cluster `up` started last: a host copy of its state volume's
    metrics (runs/<name>/state-metrics/) or runs/<name>/metrics/ of a local run of the
    same name, whichever is newer."""
    out = out or sys.stdout
    current = runs_dir / "current.json"
    try:
        rec = json.loads(current.read_text(encoding="utf-8"))
        project = rec.get("name") or rec["project"]  # the record store's, or an older version's
        run_dir = Path(rec.get("file") or rec["compose_file"]).parent
    except (OSError, ValueError, KeyError, TypeError):
        raise UsageError(
            f"no RUN_DIR given and no {current} (written by `up`); give a run directory, e.g. runs/cpu-smoke"
        ) from None
    return run_of(project, run_dir, out)


def run_of(project: str, run_dir: Path, out: TextIO) -> Path:
    """The newer metrics of the cluster `project`: its state volume's (copied to
    run_dir/state-metrics/) or those of a local run in run_dir/metrics/."""
    candidates = []
    copied = copy_volume_metrics(project, run_dir / "state-metrics", out)
    if copied is not None:
        candidates.append(copied)
    if any((run_dir / "metrics").glob("*.jsonl")):
        candidates.append(run_dir / "metrics")
    if not candidates and any((run_dir / "state-metrics").glob("*.jsonl")):
        candidates.append(run_dir / "state-metrics")  # an earlier copy; the engine is not reachable now
    if not candidates:
        raise UsageError(
            f"project {project}: no metrics in its state volume or in {run_dir}/metrics; "
            "give a run directory, e.g. runs/cpu-smoke"
        )
    chosen = max(candidates, key=_newest_record)
    others = [str(c) for c in candidates if c != chosen]
    print(f"report: the last run: {chosen}" + (f" (newer than {others[0]})" if others else ""), file=out)
    return chosen


def _newest_record(mdir: Path) -> float:
    times = [recs[-1]["time"] for p in mdir.glob("*.jsonl") if (recs := read_jsonl(p))]
    return max(times, default=0.0)


def copy_volume_metrics(project: str, dest: Path, out: TextIO) -> Optional[Path]:
    """The *.jsonl of the project's state volume copied to `dest` (via `status`'s reader);
    None when the engine, the volume or the files are not there."""
    try:
        from orchestrator import images
        from orchestrator.backends.compose import adapter

        files = adapter.read_metrics(images.client(timeout=30), project, [])
    except Exception as e:  # noqa: BLE001 - no Docker SDK or engine: fall back to the host's files
        print(f"report: state volume of {project} not read ({' '.join(str(e).split())[:120]})", file=out)
        return None
    if not files:
        return None
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob("*.jsonl"):
        old.unlink()
    for name, lines in files.items():
        (dest / name).write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"report: copied {len(files)} metrics files of project {project}'s state volume to {dest}", file=out)
    return dest


def default_out(runs: Sequence[Run]) -> Path:
    if len(runs) == 1:
        return runs[0].path / "report"
    common = Path(os.path.commonpath([str(r.path.resolve()) for r in runs]))
    return common / "report" if common != Path(common.anchor) else RUNS / "report"


# --- command line ---------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "run_dirs",
        nargs="*",
        metavar="RUN_DIR",
        help="run directories (with metrics/*.jsonl); several: one line per run on each plot "
        "(default: the last `up`, or its local run)",
    )
    p.add_argument(
        "--name",
        metavar="NAME",
        help="the run of that name (runs/NAME/ and its state volume), as `up --name` and `local --name` call it",
    )
    p.add_argument(
        "-o",
        "--output",
        metavar="OUT_DIR",
        help="where the PNGs go (default: RUN_DIR/report; several runs: their parent's report/)",
    )
    p.add_argument(
        "--threshold",
        type=float,
        default=THRESHOLD,
        metavar="ACC",
        help=f"accuracy for the 'time to' column (default {THRESHOLD})",
    )


def main(
    run_dirs: Iterable[str],
    output: Optional[str] = None,
    threshold: float = THRESHOLD,
    out: Optional[TextIO] = None,
    name: Optional[str] = None,
) -> int:
    out = out or sys.stdout
    require_matplotlib()
    dirs = [Path(d) for d in run_dirs]
    if name is not None:
        if dirs:
            raise UsageError("give run directories or --name, not both")
        if not (RUNS / name).is_dir():
            raise UsageError(f"--name {name}: no run of that name here ({RUNS / name} does not exist)")
        dirs = [run_of(name, RUNS / name, out)]
    dirs = dirs or [last_run(out=out)]
    runs = [load_run(d) for d in dirs]
    target = Path(output) if output else default_out(runs)
    written = write_report(runs, target, threshold)
    print((target / "summary.txt").read_text(encoding="utf-8"), end="", file=out)
    print(f"report: wrote {', '.join(p.name for p in written)} in {target}", file=out)
    return 0


def run_cli(args: argparse.Namespace) -> int:
    return main(args.run_dirs, args.output, args.threshold, name=args.name)
