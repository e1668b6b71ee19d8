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
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "cpu-smoke.yaml"


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
    with tempfile.TemporaryDirectory(prefix="bench-local-") as tmp:
        argv = [sys.executable, "-m", "orchestrator", "local", "-c", str(CONFIG), "--workers", str(workers)]
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        proc = subprocess.Popen(
            argv, cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.communicate()
            raise RuntimeError(f"orchestrator local did not finish within {timeout:.0f} s") from None
        if proc.returncode != 0:
            raise RuntimeError(
                f"orchestrator local exited {proc.returncode}: "
                + " | ".join(out.decode(errors="replace").strip().splitlines()[-3:])
            )
        metrics = next(Path(tmp, "runs").glob("*/metrics/ps.jsonl"))
        return _throughput(metrics.read_text().splitlines())


def run_compose(workers: int, timeout: float) -> dict[str, float]:
    from orchestrator import images
    from orchestrator.backends import command
    from orchestrator.backends.compose import adapter
    from orchestrator.render import compose
    from orchestrator.render.yamlio import write_atomic
    from orchestrator.topology.model import load_with
    from orchestrator.topology.services import service_names

    t = load_with(str(CONFIG), workers=workers)
    client = images.client()
    found = adapter.detect()
    name = f"bench-{os.getpid()}"
    with tempfile.TemporaryDirectory(prefix="bench-compose-") as tmp:
        proj = adapter.Project(name, str(Path(tmp) / "compose.yaml"), str(ROOT))
        try:
            write_atomic(proj.file, compose.dump(compose.render(t), t.name))
            base, pip_source = images.source(t, offline=True)
            images.build(t.image_tag, base, pip_source, out=io.StringIO())
            command.run(adapter.up_argv(found, proj), capture=True)
            finished = adapter.wait_exited(client, name, len(service_names(t)), timeout, io.StringIO())
            if finished is None:
                raise RuntimeError(f"the compose run did not end within {timeout:.0f} s")
            containers = adapter.containers(client, name)
            lines = adapter.read_metrics(client, name, containers).get("ps.jsonl", [])
            return _throughput(lines)
        finally:
            command.run(adapter.down_argv(found, proj, volumes=True), capture=True, check=False)


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
            print(f"bench containers: [{repeat}/{args.repeats}] {kind} ...", file=sys.stderr, flush=True)
            try:
                runs[kind].append(fn(args.workers, args.timeout))
            except Exception as error:  # noqa: BLE001 - one failed run is reported, the others stand
                failures.append(f"{kind} run {repeat}: {type(error).__name__}: {error}")
                print(f"bench containers: {failures[-1]}", file=sys.stderr, flush=True)
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
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(
                {
                    "summary": summary,
                    "compose_vs_processes": ratio,
                    "runs": runs,
                    "failures": failures,
                    "workers": args.workers,
                },
                f,
                indent=2,
            )
        print(f"wrote {args.json}")
    return 1 if failures or ratio is None else 0
