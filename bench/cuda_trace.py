"""`python -m bench.cuda_trace --after N --steps P --out FILE -- ARGV...`: `python -m app ARGV`
with a torch.profiler trace of its batches N+1..N+P (`bench cuda`'s GPU idle share).

The profiler starts when the app's training loop reports batch N done and stops P batches
later (app.training.loop.Reporter.batch_done is called once a batch, by a PS worker and by an
allreduce rank alike); the trace (Chrome format, CPU and CUDA activity) is written to FILE, its
profiled span marked by one range named SPAN. `idle_share` reads such traces: the share of the
span in which the GPU ran nothing (no kernel, copy or fill) of any of them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

SPAN = "bench-cuda-steps"
GPU_WORK = ("kernel", "gpu_memcpy", "gpu_memset")


class Tracer:
    """Profiles the batches after `after` for `steps`, then writes the trace to `out`."""

    def __init__(self, after: int, steps: int, out: Path) -> None:
        self.after, self.steps, self.out = after, steps, out
        self.batches = 0
        self.profiler: Any = None
        self.span: Any = None

    def batch_done(self) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile

        self.batches += 1
        if self.batches == self.after and self.steps > 0:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            self.profiler = profile(activities=activities)
            self.profiler.__enter__()
            self.span = torch.autograd.profiler.record_function(SPAN)
            self.span.__enter__()
        elif self.profiler is not None and self.batches == self.after + self.steps:
            self.stop()

    def stop(self) -> None:
        if self.profiler is None:
            return
        self.span.__exit__(None, None, None)
        self.profiler.__exit__(None, None, None)
        self.profiler.export_chrome_trace(str(self.out))
        self.profiler = None


def run(argv: list[str]) -> int:
    from app import __main__ as app_main
    from app.training import loop

    p = argparse.ArgumentParser(prog="python -m bench.cuda_trace")
    p.add_argument("--after", type=int, required=True, help="batches before the profiled ones")
    p.add_argument("--steps", type=int, required=True, help="batches profiled")
    p.add_argument("--out", type=Path, required=True, help="the Chrome trace to write")
    p.add_argument("app", nargs=argparse.REMAINDER, help="-- then the app's arguments")
    args = p.parse_args(argv)
    tracer = Tracer(args.after, args.steps, args.out)
    done = loop.Reporter.batch_done

    def batch_done(self: loop.Reporter, *a: Any, **kw: Any) -> None:
        done(self, *a, **kw)
        tracer.batch_done()

    loop.Reporter.batch_done = batch_done  # type: ignore[method-assign]
    app_args = args.app[1:] if args.app[:1] == ["--"] else args.app
    return app_main.main(app_args)


def intervals(trace: dict[str, Any]) -> tuple[tuple[float, float] | None, list[tuple[float, float]]]:
    """(the profiled span, the GPU's busy intervals) of one Chrome trace, in microseconds on the
    host's clock (the trace's base time added, so traces of two processes line up)."""
    base = trace.get("baseTimeNanoseconds", 0) / 1000
    span, busy = None, []
    for event in trace.get("traceEvents", []):
        if "ts" not in event or "dur" not in event:
            continue
        start = base + float(event["ts"])
        end = start + float(event["dur"])
        if event.get("name") == SPAN and event.get("cat") in ("user_annotation", "cpu_op", None):
            span = (start, end)
        elif event.get("cat") in GPU_WORK:
            busy.append((start, end))
    return span, busy


def idle_share(traces: list[dict[str, Any]]) -> float | None:
    """The share of the profiled span (the span every trace covers) in which no trace shows GPU
    work: 1 less the union of their kernels, copies and fills over the span's length. None
    without a span or without any GPU work (a CPU run)."""
    spans, busy = [], []
    for trace in traces:
        span, work = intervals(trace)
        if span is not None:
            spans.append(span)
        busy += work
    if not spans or not busy:
        return None
    start, end = max(s for s, _ in spans), min(e for _, e in spans)
    if end <= start:
        return None
    covered, reach = 0.0, start
    for s, e in sorted(busy):
        s, e = max(s, reach), min(e, end)
        if e > s:
            covered += e - s
            reach = e
    return 1 - covered / (end - start)


def read(paths: list[Path]) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in paths if p.exists()]


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
