"""`python -m bench [--json FILE]`: the headline table (each strategy's step against compute
alone, a few minutes); `python -m bench full [--quick] [--json FILE]`: the full matrix;
`python -m bench compare OLD.json NEW.json`; `python -m bench constants`: the step model's
constants (docs/performance.md); `python -m bench gpu [--full] [--json FILE]`: the GPU regime
(ResNet-18's bytes, a sleep for its compute); `python -m bench containers|scan|data|wire|hosts`."""

from __future__ import annotations

import argparse
import ctypes
import functools
import itertools
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench import harness, headline, report
from bench.models import FULL_MODELS, HEADLINE_MODELS, SPECS
from bench.node import APP_PATH_ENV

# Warm-up and timed steps per worker of a headline case: a 2-6 s window on an idle 2-core CPU VM.
HEADLINE_STEPS = {"resnet18-10": (3, 16), "mnist-cnn": (4, 30)}
OFFICIAL_MODELS = ("resnet18-10",)  # the models the published example's row runs (bench/official.py)
HEADLINE_TAIL_S = 1.0  # async cases only: keep stepping while the other worker ends its count


def memcpy_seconds(floats: int, repeats: int) -> float:
    """Median time of two memcpy(3) calls of 4*floats bytes: the message in, the state out."""
    import torch

    a, b, c = torch.randn(floats), torch.empty(floats), torch.randn(floats)
    d = torch.empty(floats)
    size = 4 * floats
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        ctypes.memmove(b.data_ptr(), a.data_ptr(), size)
        ctypes.memmove(d.data_ptr(), c.data_ptr(), size)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _state_floats(model: str) -> int:
    from bench.models import state_floats

    params, buffers = state_floats(SPECS[model].model())
    return params + buffers


def headline_params(system: str, model: str, steps: int | None) -> dict[str, Any]:
    """A headline case's parameters: one thread per process, a fixed step count."""
    warmup, count = HEADLINE_STEPS.get(model, (5, 30))
    return dict(
        warmup=warmup,
        steps=steps or count,
        threads=1,
        compute=True,
        compute_seconds=None,
        tail=HEADLINE_TAIL_S if system in ("app", "app-overlap") else 0.0,
        floats=_state_floats(model),
        shards=1,
        compress="none",
        overlap=system == "app-overlap",
        strategy="sync" if system == "app-sync" else "async",
        transports="uv" if system == "ref-uv" else None,
        allreduce=system == "allreduce",
        workers_only=system in ("compute", "allreduce"),
    )


def official_case(model: str, workers: int, steps: int | None, timeout: float) -> dict[str, Any]:
    """The published PyTorch batch PS example (bench/official.py) on ResNet-18, 10 classes, batch
    20 of 3x32x32 (the only model it is patched for), with the headline's warm-up and step count,
    one thread per process as every row; timed as bench/gpu_report.py times a case."""
    import subprocess
    import tempfile

    from bench.gpu_report import steady_step
    from bench.procs import CaseFailed

    warmup, count = HEADLINE_STEPS[model]
    count = steps or count
    with tempfile.TemporaryDirectory(prefix="bench-official-") as tmp:
        out = os.path.join(tmp, "steps.json")
        argv = [sys.executable, "-m", "bench.official", "--model", "resnet18", "--trainers", str(workers)]
        argv += ["--warmup", str(warmup), "--steps", str(count), "--out", out]
        env = dict(
            os.environ, OMP_NUM_THREADS="1", PYTHONPATH=harness.python_path(Path(__file__).resolve().parent.parent)
        )
        try:
            proc = subprocess.run(argv, capture_output=True, timeout=timeout, env=env)
        except subprocess.TimeoutExpired:
            raise CaseFailed(f"did not finish within {timeout:.0f} s") from None
        if proc.returncode != 0 or not os.path.exists(out):
            tail = " | ".join(proc.stderr.decode(errors="replace").strip().splitlines()[-3:])
            raise CaseFailed(f"bench.official exited {proc.returncode}: {tail}")
        with open(out, encoding="utf-8") as f:
            ends = json.load(f)["step_ends"]
    try:
        steady = steady_step(ends, warmup)
    except ValueError as error:
        raise CaseFailed(str(error)) from None
    return {
        "workers": [
            {"steps": steady["steps"], "window_s": step * steady["steps"], "compute_s": None, "comm_s": None}
            for step in steady["per_worker_step_s"]
        ],
        "ps": {},
    }


def run_headline(args: argparse.Namespace) -> int:
    from bench.procs import Case, run_case

    started = time.monotonic()
    where = harness.machine()
    runs: list[dict[str, Any]] = []
    failures: list[str] = []
    for repeat in range(1, args.repeats + 1):
        for model in args.models.split(","):
            for system in args.systems.split(","):
                if system == "official" and model not in OFFICIAL_MODELS:
                    continue  # the published example is patched for ResNet-18 only
                if system == "official":
                    case = functools.partial(official_case, model, args.workers, args.steps, args.timeout)
                else:
                    params = headline_params(system, model, args.steps)
                    case = functools.partial(run_case, Case(system, model, args.workers), params, args.timeout)
                label = f"[{repeat}/{args.repeats}] {model} x{args.workers} {system}"
                raw = harness.attempt("bench", label, case, failures)
                if raw is not None:
                    runs.append(headline.case_row(system, model, args.workers, raw))
    rows = headline.aggregate(runs)
    wall = time.monotonic() - started
    where["loadavg_end"] = os.getloadavg()
    what = "steady state: the timed steps after the warm-up ones, one thread per process"
    text = headline.table(rows) + "\n" + harness.run_line(what, args.repeats, wall, where)
    return harness.close(
        text, failures, args.json, lambda: headline.document(rows, runs, vars(args), where, failures, wall)
    )


def run_compare(args: argparse.Namespace) -> int:
    docs = []
    for path in (args.old, args.new):
        try:
            with open(path, encoding="utf-8") as f:
                docs.append(json.load(f))
        except (OSError, ValueError) as error:
            print(f"compare: {path}: not a bench JSON file ({error})", file=sys.stderr)
            return 2
    try:
        print(headline.compare_table(headline.compare(*docs)))
    except (ValueError, KeyError) as error:
        print(f"compare: {error}", file=sys.stderr)
        return 2
    return 0


def full_systems(model: str) -> list[str]:
    """The full matrix's systems for `model`: the no-compute and sharded rows on resnet18 only."""
    extra = ["app-comm", "app-comm-bf16", "app-sharded"] if model == "resnet18" else []
    return ["app", "app-overlap", "app-bf16", "ref", "ref-tuned", "gloo", *extra]


def full_params(args: argparse.Namespace, system: str, floats: int) -> dict[str, Any]:
    """A full-matrix case's parameters: a timed window of --seconds after the warm-up steps."""
    return dict(
        warmup=args.warmup,
        seconds=args.seconds,
        tail=min(1.5, args.seconds / 3),
        compute_seconds=min(2.0, args.seconds / 2),
        floats=floats,
        compute=not system.startswith("app-comm") and system != "app-sharded",
        shards=2 if system == "app-sharded" else 1,
        overlap=system == "app-overlap",
        tuned=system == "ref-tuned",
        compress="bf16" if system.endswith("bf16") else "none",
    )


def run_main(args: argparse.Namespace) -> int:
    from bench.procs import Case, run_case

    models = args.models.split(",")
    workers = [int(w) for w in args.workers.split(",")]
    floats = {m: _state_floats(m) for m in models}
    runs: list[dict[str, Any]] = []
    failures: list[str] = []
    started = time.monotonic()
    for repeat, model, n in itertools.product(range(1, args.repeats + 1), models, workers):
        for system in full_systems(model):
            first = model == models[0] and n == workers[0] and system in ("app", "ref")
            case = functools.partial(
                run_case,
                Case(system, model, n),
                full_params(args, system, floats[model]),
                timeout=90 + 4 * args.seconds,
                idle_seconds=args.idle_seconds if first else 0.0,
            )
            raw = harness.attempt("bench", f"[{repeat}/{args.repeats}] {model} x{n} {system}", case, failures)
            if raw is not None:
                runs.append(report.case_row(system, model, n, SPECS[model].batch_size, raw))
        seconds = memcpy_seconds(floats[model], repeats=20)
        runs.append(report.memcpy_row(model, n, floats[model], seconds))
    rows = report.aggregate(runs)
    rs = report.ratios(rows)
    text = f"{report.table(rows)}\n\n{report.ratio_lines(rs)}\n\n{args.repeats} repeat(s), medians; (lo-hi) is "
    text += f"the updates/s range over repeats; {time.monotonic() - started:.0f} s"
    doc = dict(kind="full", rows=rows, ratios=rs, goals_met=report.verdicts(rs), settings=vars(args), runs=runs)
    return harness.close(text, failures, args.json, lambda: dict(schema=headline.SCHEMA, **doc, failures=failures))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    sub = parser.add_subparsers(dest="command")
    parser.set_defaults(command="headline")
    for p in (parser, sub.add_parser("headline", help="each strategy's step against compute alone (default)")):
        p.add_argument("--json", metavar="FILE", help="write rows, settings and raw runs here")
        p.add_argument("--models", default=",".join(HEADLINE_MODELS), help="comma-separated: %(default)s")
        p.add_argument(
            "--systems",
            default=",".join(headline.DEFAULT_SYSTEMS),
            help="comma-separated: %(default)s (also: ref, ref-uv, the re-implemented example)",
        )
        p.add_argument("--workers", type=int, default=2)
        p.add_argument(
            "--steps",
            type=int,
            help="timed steps per worker (default: per model, "
            + ", ".join(f"{m} {s}" for m, (_, s) in HEADLINE_STEPS.items())
            + ")",
        )
        p.add_argument("--repeats", type=int, default=1)
        p.add_argument("--timeout", type=float, default=120.0, help="seconds per case")
        _app_path(p)
    f = sub.add_parser("full", help="the full matrix: systems x models x worker counts")
    f.add_argument("--quick", action="store_true", help="one repeat of short windows")
    f.add_argument("--json", metavar="FILE", help="write rows, ratios and raw runs here")
    f.add_argument("--models", default=",".join(FULL_MODELS), help="comma-separated: %(default)s")
    f.add_argument("--workers", default="1,2", help="comma-separated worker counts")
    f.add_argument("--repeats", type=int, default=3)
    f.add_argument("--seconds", type=float, default=4.0, help="measured window per case")
    f.add_argument("--warmup", type=int, default=3)
    f.add_argument("--idle-seconds", type=float, default=3.0)
    _app_path(f)
    cmp = sub.add_parser("compare", help="two --json files side by side (headline or full)")
    cmp.add_argument("old")
    cmp.add_argument("new")
    c = sub.add_parser("containers", help="cpu-smoke as processes vs in compose (needs Docker)")
    c.add_argument("--repeats", type=int, default=3)
    c.add_argument("--workers", type=int, default=2)
    c.add_argument("--timeout", type=float, default=600)
    c.add_argument("--json", metavar="FILE")
    from bench import constants, cuda, data_pipeline, gpu, hosts, imagefolder_scan, wire

    constants.add_parser(sub)
    gpu.add_parser(sub)
    cuda.add_parser(sub)
    imagefolder_scan.add_parser(sub)
    data_pipeline.add_parser(sub)
    wire.add_parser(sub)
    hosts.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from bench import data_pipeline, imagefolder_scan

    if args.command == "constants":
        from bench import constants

        return constants.main(args)
    if args.command == "data":
        return data_pipeline.main(args)
    if args.command == "gpu":
        from bench import gpu

        gpu.resolve(args)
        return gpu.main(args)
    if args.command == "cuda":
        from bench import cuda

        return cuda.main(args)
    if args.command == "wire":
        from bench import wire

        return wire.main(args)
    if args.command == "hosts":
        from bench import hosts

        return hosts.main(args)
    if args.command == "scan":
        return imagefolder_scan.main(args)
    if args.command == "containers":
        from bench.containers import main as containers_main

        return containers_main(args)
    if args.command == "compare":
        return run_compare(args)
    problem = _check(args)
    if problem:
        print(f"python -m bench: {problem}", file=sys.stderr)
        return 2
    if args.app_path:
        os.environ[APP_PATH_ENV] = os.path.abspath(args.app_path)
        sys.path.insert(0, os.environ[APP_PATH_ENV])
    if args.command == "headline":
        return run_headline(args)
    if args.quick:
        args.repeats, args.seconds, args.warmup, args.idle_seconds = 1, 1.5, 2, 2.0
    return run_main(args)


def _app_path(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--app-path",
        metavar="DIR",
        help="measure the app/ under DIR (e.g. `git archive HEAD app | tar -x -C DIR`) instead of this checkout's",
    )


def _check(args: argparse.Namespace) -> str | None:
    """The first bad model or system named, as one line; None when all are known."""
    for model in args.models.split(","):
        if model not in SPECS:
            return f"--models: {model!r} is not one of {', '.join(SPECS)}"
    for system in getattr(args, "systems", "").split(",") if args.command == "headline" else []:
        if system not in headline.SYSTEMS:
            return f"--systems: {system!r} is not one of {', '.join(headline.SYSTEMS)}"
    return None


if __name__ == "__main__":
    sys.exit(main())
