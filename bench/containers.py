"""The cost of containers: the cpu-smoke run as local processes and in compose.

Processes: `python -m orchestrator local -c configs/cpu-smoke.yaml --workers N`
in a scratch directory (its runs/ stays out of the checkout). Compose: the
same topology rendered, built (offline image, layer cache) and started under
a project of its own (`bench-<pid>`), so it never touches another run's
containers or `runs/current.json`; torn down with its volume afterwards.
Throughput of each run is the PS's: updates x batch / seconds, from its
`end` metrics line (`seconds` counts from the moment every worker joined).
Needs a Docker engine (`make engine`).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time
from typing import Any, Optional

from bench import harness, launch

CONFIG = launch.ROOT / "configs" / "cpu-smoke.yaml"


def throughput(ps_lines: list[str], batch_size: int) -> Optional[dict[str, float]]:
    """samples/s and updates/s from a PS metrics file's `end` line (None without one)."""
    for line in reversed(ps_lines):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("event") == "end" and record.get("seconds"):
            seconds, updates = float(record["seconds"]), int(record["step"])
            return {
                "updates": updates,
                "seconds": seconds,
                "updates_per_s": updates / seconds,
                "samples_per_s": updates * batch_size / seconds,
            }
    return None


def run_processes(workers: int, timeout: float) -> dict[str, float]:
    from orchestrator.topology.model import load_with

    files = launch.metrics("local", load_with(str(CONFIG), workers=workers), timeout)
    return _throughput(files.get("ps.jsonl", []))


def run_compose(workers: int, timeout: float) -> dict[str, float]:
    from orchestrator.topology.model import load_with

    t = load_with(str(CONFIG), workers=workers)
    launch.build_image(t)
    return _throughput(launch.metrics("compose", t, timeout, f"bench-{os.getpid()}").get("ps.jsonl", []))


def _throughput(lines: list[str]) -> dict[str, float]:
    import yaml

    batch = yaml.safe_load(CONFIG.read_text())["train"]["batch_size"]
    result = throughput(lines, batch)
    if result is None:
        raise RuntimeError("the PS wrote no `end` metrics line")
    return result


def main(args: argparse.Namespace) -> int:
    runs: dict[str, list[dict[str, float]]] = {"processes": [], "compose": []}
    failures = []
    started = time.monotonic()
    for repeat in range(1, args.repeats + 1):  # interleaved, so load drifts hit both alike
        for kind, fn in (("processes", run_processes), ("compose", run_compose)):
            label = f"[{repeat}/{args.repeats}] {kind}"
            got = harness.attempt(
                "bench containers", label, functools.partial(fn, args.workers, args.timeout), failures
            )
            if got is not None:
                runs[kind].append(got)
    summary: dict[str, Any] = {}
    for kind, rs in runs.items():
        if rs:
            sps = [r["samples_per_s"] for r in rs]
            summary[kind] = {
                "samples_per_s": statistics.median(sps),
                "range": [min(sps), max(sps)],
                "updates_per_s": statistics.median(r["updates_per_s"] for r in rs),
                "seconds": statistics.median(r["seconds"] for r in rs),
                "repeats": len(rs),
            }
            print(
                f"{kind:<10} samples/s {summary[kind]['samples_per_s']:8.0f} "
                f"({min(sps):.0f}-{max(sps):.0f})  updates/s {summary[kind]['updates_per_s']:7.1f}  "
                f"training s {summary[kind]['seconds']:5.2f}  ({len(rs)} runs)"
            )
    ratio = None
    if "processes" in summary and "compose" in summary:
        ratio = summary["compose"]["samples_per_s"] / summary["processes"]["samples_per_s"]
        print(
            f"compose / processes throughput: {ratio:.2f} (goal >= 0.9: "
            f"{'met' if ratio >= 0.9 else 'NOT met'}); cpu-smoke, {args.workers} workers, medians; "
            f"{time.monotonic() - started:.0f} s"
        )
    for f in failures:
        print(f"failed: {f}")
    if args.json:
        doc = {"summary": summary, "compose_vs_processes": ratio, "runs": runs, "failures": failures}
        harness.write_json(args.json, dict(doc, workers=args.workers))
    return 1 if failures or ratio is None else 0
