"""`python -m bench [--quick] [--json FILE]`, `python -m bench containers|scan|data`."""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

from bench import report
from bench.models import SPECS
from bench.node import APP_PATH_ENV


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


def run_main(args: argparse.Namespace) -> int:
    from bench.procs import Case, CaseFailed, run_case
    models = args.models.split(",")
    workers = [int(w) for w in args.workers.split(",")]
    params = dict(warmup=args.warmup, seconds=args.seconds, tail=min(1.5, args.seconds / 3),
                  compute=True, compute_seconds=min(2.0, args.seconds / 2))
    floats = {m: _state_floats(m) for m in models}
    runs: list[dict[str, Any]] = []
    failures: list[str] = []
    started = time.monotonic()
    for repeat in range(1, args.repeats + 1):
        for model in models:
            for n in workers:
                systems = ["app", "app-overlap", "app-bf16", "ref", "ref-tuned", "gloo"] + (
                    ["app-comm", "app-comm-bf16", "app-sharded"] if model == "resnet18" else [])
                for system in systems:
                    case = Case(system, model, n)
                    idle = args.idle_seconds if (model == models[0] and n == workers[0]
                                                 and system in ("app", "ref")) else 0.0
                    p = dict(params, floats=floats[model],
                             compute=not system.startswith("app-comm") and system != "app-sharded",
                             shards=2 if system == "app-sharded" else 1,
                             overlap=system == "app-overlap", tuned=system == "ref-tuned",
                             compress="bf16" if system.endswith("bf16") else "none")
                    label = f"[{repeat}/{args.repeats}] {model} x{n} {system}"
                    print(f"bench: {label} ...", file=sys.stderr, flush=True)
                    try:
                        raw = run_case(case, p, timeout=90 + 4 * args.seconds, idle_seconds=idle)
                    except CaseFailed as error:
                        failures.append(f"{label}: {error}")
                        print(f"bench: {label}: FAILED: {error}", file=sys.stderr, flush=True)
                        continue
                    runs.append(report.case_row(system, model, n, SPECS[model].batch_size, raw))
                seconds = memcpy_seconds(floats[model], repeats=20)
                runs.append(report.memcpy_row(model, n, floats[model], seconds))
    rows = report.aggregate(runs)
    rs = report.ratios(rows)
    print(report.table(rows))
    print()
    print(report.ratio_lines(rs))
    print(f"\n{args.repeats} repeat(s), medians; ({'lo-hi'}) is the updates/s range over repeats; "
          f"{time.monotonic() - started:.0f} s")
    if failures:
        print("failed cases:\n  " + "\n  ".join(failures))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"rows": rows, "ratios": rs, "goals_met": report.verdicts(rs),
                       "settings": vars(args), "runs": runs, "failures": failures}, f, indent=2)
        print(f"wrote {args.json}")
    return 1 if failures else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    sub = parser.add_subparsers(dest="command")
    parser.set_defaults(command="run")
    for p in (parser, sub.add_parser("run", help="the PS bench (default)")):
        p.add_argument("--quick", action="store_true", help="one repeat of short windows")
        p.add_argument("--json", metavar="FILE", help="write rows, ratios and raw runs here")
        p.add_argument("--models", default=",".join(SPECS), help="comma-separated: %(default)s")
        p.add_argument("--workers", default="1,2", help="comma-separated worker counts")
        p.add_argument("--repeats", type=int, default=3)
        p.add_argument("--seconds", type=float, default=4.0, help="measured window per case")
        p.add_argument("--warmup", type=int, default=3)
        p.add_argument("--idle-seconds", type=float, default=3.0)
        p.add_argument("--app-path", metavar="DIR",
                       help="measure the app/ under DIR (e.g. `git archive HEAD app | tar -x -C DIR`) "
                            "instead of this checkout's")
    c = sub.add_parser("containers", help="cpu-smoke as processes vs in compose (needs Docker)")
    c.add_argument("--repeats", type=int, default=3)
    c.add_argument("--workers", type=int, default=2)
    c.add_argument("--timeout", type=float, default=600)
    c.add_argument("--json", metavar="FILE")
    from bench import data_pipeline, imagefolder_scan
    imagefolder_scan.add_parser(sub)
    data_pipeline.add_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "data":
        return data_pipeline.main(args)
    if args.command == "scan":
        return imagefolder_scan.main(args)
    if args.command == "containers":
        from bench.containers import main as containers_main
        return containers_main(args)
    if args.quick:
        args.repeats, args.seconds, args.warmup, args.idle_seconds = 1, 1.5, 2, 2.0
    if args.app_path:
        os.environ[APP_PATH_ENV] = os.path.abspath(args.app_path)
        sys.path.insert(0, os.environ[APP_PATH_ENV])
    return run_main(args)


if __name__ == "__main__":
    sys.exit(main())
