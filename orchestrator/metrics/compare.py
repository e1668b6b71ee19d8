"""`python -m orchestrator compare`: the same short CPU job under each strategy, side by side.

Each strategy runs configs/cpu-smoke.yaml (digits, the small CNN) with the
same workers, epochs and seed as local processes (orchestrator/verbs/local.py) in
`<runs>/<strategy>/` (metrics/, checkpoints/, output.log, run.json), one after
the other; then `report` draws all of them on one set of plots in
`<runs>/report/` and a table is printed: strategy, time and samples to 0.90
held-out accuracy, final accuracy, samples/s of all workers together.

Each entry of `--strategies` is a strategy with optional `+` options:
`async+bf16`, `async+fp16` (compress), `async+overlap`, `ssp+s2` (staleness
2), `ssp+slr` (staleness-aware lr); e.g. `--strategies
async,async+bf16,async+fp16` shows what gradient compression does to
accuracy. The run of an entry is named after it (`async-bf16`).

A strategy that fails (exit status != 0) is shown as failed, with the end of
its log, and the others still run; the exit status is then 1. Ctrl-C stops
the whole comparison.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, TextIO

from app.contract import STRATEGIES
from orchestrator.errors import UsageError
from orchestrator.metrics import run_metrics
from orchestrator.metrics.report import require_matplotlib, write_report
from orchestrator.metrics.run_metrics import THRESHOLD, Run, Summary, fmt
from orchestrator.paths import SMOKE_CONFIG
from orchestrator.topology.model import Topology, load
from orchestrator.verbs import local

BASE_CONFIG = SMOKE_CONFIG
RUNS_DIR = "runs/compare"
WORKERS = 2
EPOCHS = 10
EVAL_EVERY = 20  # finer than cpu-smoke's 100: the time to 0.90 is read at eval points
LOG_TAIL = 15


OPTIONS: dict[str, dict[str, Any]] = {
    "overlap": {"overlap": True},
    "bf16": {"compress": "bf16"},
    "fp16": {"compress": "fp16"},
    "slr": {"staleness_lr": True},
}


def parse_entry(entry: str) -> tuple[str, dict]:
    """`ssp+s2+slr` -> ("ssp", {"staleness": 2, "staleness_lr": True}); ValueError when bad."""
    strategy, *options = entry.split("+")
    if strategy not in STRATEGIES:
        raise ValueError(f"{strategy!r} is not one of {', '.join(STRATEGIES)}")
    update: dict = {}
    for option in options:
        if option in OPTIONS:
            update.update(OPTIONS[option])
        elif option[:1] == "s" and option[1:].isdigit():
            update["staleness"] = int(option[1:])
        else:
            raise ValueError(f"option {option!r} of {entry!r} is not one of {', '.join(OPTIONS)}, s<N>")
    return strategy, update


def topology_for(
    base: Topology, entry: str, *, workers: int, epochs: int, eval_every: int, source: str = BASE_CONFIG
) -> Topology:
    """`base` with this strategy (and + options), epoch count and eval interval, named after
    the entry (so local.run puts it in <runs>/<entry>/), with `workers` workers."""
    strategy, options = parse_entry(entry)
    train = dataclasses.replace(base.train, epochs=epochs, eval_every=eval_every, **options)
    t = base.model_copy(update={"name": entry.replace("+", "-"), "train": train})
    t = t.with_strategy(strategy, source=f"{source} with --strategy {entry}")
    return t.with_workers(workers, source=f"{source} with --strategy {entry}")  # both check the result


@dataclass
class Outcome:
    strategy: str
    run_dir: Path
    code: Optional[int]  # exit status of the run; None: not run
    seconds: float  # wall time of the whole run, process start-up included
    summary: Optional[Summary] = None
    run: Optional[Run] = None


def run_one(t: Topology, runs_dir: Path, *, source: str, verbose: bool, out: TextIO) -> Outcome:
    """Run `t` as local processes in a fresh <runs_dir>/<strategy>/; its output to output.log."""
    strategy = t.name  # the entry: async, async-bf16, ...
    run_dir = runs_dir / t.name
    shutil.rmtree(run_dir, ignore_errors=True)  # metrics files are appended to: start clean
    run_dir.mkdir(parents=True)
    info = {
        "strategy": t.train.strategy,
        "label": strategy,
        "workers": t.workers.count,
        "batch_size": t.train.batch_size,
        "epochs": t.train.epochs,
        "config": source,
        "topology": t.model_dump(mode="json"),
    }
    _write_json(run_dir / "run.json", info)
    log_path = run_dir / "output.log"
    print(
        f"==> compare: {strategy}: {t.workers.count} workers, {t.train.epochs} epochs, "
        f"batch {t.train.batch_size}, log {log_path}",
        file=out,
        flush=True,
    )
    start = time.monotonic()
    with open(log_path, "w", encoding="utf-8") as log:
        with contextlib.redirect_stdout(out if verbose else log):
            code = local.run(t, source=source, runs_dir=str(runs_dir))
    seconds = time.monotonic() - start
    _write_json(run_dir / "run.json", {**info, "exit_code": code, "seconds": round(seconds, 1)})
    return Outcome(strategy, run_dir, code, seconds)


def _write_json(path: Path, doc: dict) -> None:
    path.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")


def attach_summary(o: Outcome, threshold: float) -> Outcome:
    """The run's records and summary, when it left any."""
    try:
        o.run = run_metrics.load_run(o.run_dir)
    except UsageError:
        return o
    o.run.label = o.strategy
    o.summary = run_metrics.summarize(o.run, threshold)
    return o


def format_table(outcomes: Sequence[Outcome], threshold: float = THRESHOLD) -> list[str]:
    """strategy, time to `threshold`, final accuracy, samples/s (+ samples to it, wall time, status)."""
    th = f"{threshold:.2f}"
    w = max([10] + [len(o.strategy) for o in outcomes])
    lines = [
        f"{'STRATEGY':<{w}} {'TIME TO ' + th:>12} {'FINAL ACC':>9} {'SAMPLES/S':>9} "
        f"{'SAMPLES TO ' + th:>15} {'WALL':>6}  STATUS"
    ]
    for o in outcomes:
        s = o.summary
        if o.code is None:
            status = "not run"
        elif o.code == 0:
            status = "ok"
        else:
            status = f"failed (exit {o.code})"
        if s is not None and o.code == 0 and s.time_to is None:
            status = f"ok, never reached {th}"
        lines.append(
            f"{o.strategy:<{w}} {fmt(s and s.time_to, '.1f', ' s'):>12} "
            f"{fmt(s and s.final_value, '.4f'):>9} {fmt(s and s.samples_per_s, '.0f'):>9} "
            f"{fmt(s and s.samples_to, '.0f'):>15} {o.seconds:>5.0f}s  {status}"
        )
    return lines


def _tail(path: Path, n: int) -> list[str]:
    try:
        return path.read_text(encoding="utf-8", errors="replace").splitlines()[-n:]
    except OSError:
        return []


def run(
    strategies: Sequence[str],
    *,
    workers: int = WORKERS,
    epochs: int = EPOCHS,
    eval_every: int = EVAL_EVERY,
    config: str = BASE_CONFIG,
    runs_dir: str = RUNS_DIR,
    verbose: bool = False,
    threshold: float = THRESHOLD,
    out: Optional[TextIO] = None,
) -> int:
    out = out or sys.stdout
    base = load(config)
    topologies = [
        topology_for(base, s, workers=workers, epochs=epochs, eval_every=eval_every, source=config)
        for s in dict.fromkeys(strategies)
    ]  # every one checked before the first starts
    require_matplotlib()  # and the plots drawn at the end
    root = Path(runs_dir)
    started = time.monotonic()
    outcomes: list[Outcome] = []
    for t in topologies:
        o = attach_summary(run_one(t, root, source=config, verbose=verbose, out=out), threshold)
        outcomes.append(o)
        if o.code != 0:
            print(
                f"    {o.strategy}: FAILED (exit {o.code}) after {o.seconds:.0f} s; end of {o.run_dir}/output.log:",
                file=out,
            )
            for line in _tail(o.run_dir / "output.log", LOG_TAIL):
                print(f"    | {line}", file=out)
        else:
            acc = fmt(o.summary and o.summary.final_value, ".4f")
            print(f"    {o.strategy}: done in {o.seconds:.0f} s, final accuracy {acc}", file=out, flush=True)
        if o.code is not None and o.code >= 128:  # a signal (Ctrl-C): stop here
            return o.code
    runs = [o.run for o in outcomes if o.run is not None]
    if runs:
        written = write_report(runs, root / "report", threshold)
        print(f"==> report: {', '.join(p.name for p in written)} in {root / 'report'}", file=out)
    print(
        f"compare: {len(outcomes)} strategies, {workers} workers, {epochs} epochs "
        f"({config}), {time.monotonic() - started:.0f} s in all",
        file=out,
    )
    for line in format_table(outcomes, threshold):
        print(line, file=out)
    return 0 if all(o.code == 0 for o in outcomes) else 1


def _strategies(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"got {text!r}; a comma-separated list of {', '.join(STRATEGIES)}")
    for name in names:
        try:
            parse_entry(name)
        except ValueError as error:
            raise argparse.ArgumentTypeError(f"got {text!r}: {error}") from None
    return names


def add_arguments(p: argparse.ArgumentParser, positive_int) -> None:
    p.add_argument(
        "--strategies",
        type=_strategies,
        default=list(STRATEGIES),
        metavar="LIST",
        help=f"comma-separated, run in this order (default: {','.join(STRATEGIES)}); "
        "each may take +options: +overlap, +bf16, +fp16, +slr, +s<N> (staleness)",
    )
    p.add_argument(
        "--workers", type=positive_int, default=WORKERS, metavar="N", help=f"workers of every run (default {WORKERS})"
    )
    p.add_argument(
        "--epochs", type=positive_int, default=EPOCHS, metavar="N", help=f"epochs of every run (default {EPOCHS})"
    )
    p.add_argument(
        "--eval-every",
        type=positive_int,
        default=EVAL_EVERY,
        metavar="N",
        help=f"held-out evaluation every N updates (default {EVAL_EVERY})",
    )
    p.add_argument(
        "-c",
        "--config",
        default=BASE_CONFIG,
        metavar="CONFIG",
        help=f"the topology the runs start from (default {BASE_CONFIG})",
    )
    p.add_argument(
        "--runs",
        default=RUNS_DIR,
        metavar="DIR",
        help=f"where each strategy's run and the report go (default {RUNS_DIR})",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="stream every process's output, not only to output.log")


def run_cli(args: argparse.Namespace) -> int:
    return run(
        args.strategies,
        workers=args.workers,
        epochs=args.epochs,
        eval_every=args.eval_every,
        config=args.config,
        runs_dir=args.runs,
        verbose=args.verbose,
    )
