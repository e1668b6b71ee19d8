"""`python -m bench gpu`'s figures: the steady-state step of a case from the times its
workers finished their batches, the rows over repeats, the table and the JSON document.

Pure: no I/O, no timing. A case's raw result is, per worker, the times (seconds, any
origin shared by the case's workers) at which it finished each of its batches, in order.
"""

from __future__ import annotations

import functools
import statistics
from typing import Any, Optional

from bench import rows

SCHEMA = 1  # bump when a field of the JSON document changes meaning
SYSTEMS = ("compute", "async", "overlap", "sync", "allreduce", "official")
LABELS = {
    "compute": "compute alone (no PS)",
    "async": "ps-compose async",
    "overlap": "ps-compose async --overlap",
    "sync": "ps-compose sync",
    "allreduce": "allreduce (DDP, Gloo)",
    "official": "official PS example (sync)",
}
WHERE = ("processes", "containers")


def steady_step(times: list[list[float]], warmup: int, numbers: list[list[int]] | None = None) -> dict[str, Any]:
    """Seconds per step while every worker of the case is past its warm-up and none has
    ended: the window opens when the last worker finishes its `warmup`-th batch and closes
    when the first worker finishes its last one; each worker's step is the time between
    its first and last batch inside the window over the batches between them; the
    case's is the mean over workers. `numbers`: the batch each time ended (a worker that
    reports every k batches); by default the times are batches 1, 2, 3, ... ValueError
    when a worker has too few batches."""
    numbers = numbers or [list(range(1, len(t) + 1)) for t in times]
    past = [[(x, n) for x, n in zip(t, b) if n >= max(warmup, 1)] for t, b in zip(times, numbers)]
    if not times or any(len(p) < 2 for p in past):
        counts = [b[-1] if b else 0 for b in numbers]
        raise ValueError(f"a worker finished too few batches for a warm-up of {warmup}: {counts}")
    start = max(p[0][0] for p in past)
    end = min(p[-1][0] for p in past)
    per_worker, steps = [], []
    for p in past:
        inside = [(x, n) for x, n in p if start <= x <= end]
        if len(inside) < 2:
            raise ValueError("the workers' steady windows do not overlap (one ended before another warmed up)")
        (first, b0), (last, b1) = inside[0], inside[-1]
        per_worker.append((last - first) / (b1 - b0))
        steps.append(b1 - b0)
    return {
        "step_s": statistics.mean(per_worker),
        "per_worker_step_s": per_worker,
        "steps": min(steps),
        "batches": [b[-1] for b in numbers],
        "window_s": end - start,
        "window": [start, end],
    }


def cpu_per_step(seconds: dict[str, float], steady: dict[str, Any]) -> dict[str, float | None]:
    """`worker_cpu_ms`: the CPU the case's worker processes used in its steady window per step
    of any worker; `ps_cpu_ms`: its PS processes' per push (a step is one push), from
    `seconds` (role -> CPU seconds in the window, bench.host_cpu.cpu_seconds) and `steady`
    (steady_step's: the window's length and each worker's step give the steps in it). None
    for a role with no process seen (compute alone: the bench's own)."""
    steps = sum(steady["window_s"] / s for s in steady["per_worker_step_s"] if s > 0)
    return {
        f"{role}_cpu_ms": 1000 * seconds[role] / steps if role in seconds and steps > 0 else None
        for role in ("worker", "ps")
    }


def cores_floor_s(run: dict[str, Any]) -> float | None:
    """The shortest step the host's cores allow a case, from the CPU it used: in a step each of
    its `workers` takes one worker step and one PS push of CPU (`worker_cpu_ms`, `ps_cpu_ms`),
    spread at best over the `cores` the bench may use. A step near it is bound by the host's
    CPU, not by a wait. None without both figures (compute alone) or the cores."""
    worker, ps, cores = run.get("worker_cpu_ms"), run.get("ps_cpu_ms"), run.get("cores")
    if worker is None or ps is None or not cores:
        return None
    return run["workers"] * (worker + ps) / 1000 / cores


def key(run: dict[str, Any]) -> tuple[int, int, int, str, str]:
    return (run["compute_ms"], run["workers"], run["shards"], run["where"], run["system"])


def aggregate(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Median step over the repeats of each case, its range, and `vs_compute`: that step /
    the compute-alone step of the same C. `vs_processes` (containers only): / the same
    system as processes. `cpu_busy`: the median over the repeats that have it of the share
    of the host's cores busy in the steady window (bench.host_cpu), else None; the same for
    `worker_cpu_ms` and `ps_cpu_ms` (cpu_per_step), and for `floor_s` (cores_floor_s), with
    `floor_vs_compute`: that floor / the compute-alone step. Rows sorted
    by C, workers, shards, where, then SYSTEMS order."""
    groups = rows.grouped(runs, key, lambda k: (k[0], k[1], k[2], WHERE.index(k[3]), SYSTEMS.index(k[4])))
    out = []
    for (c, workers, shards, where, system), rs in groups:
        case = dict(compute_ms=c, workers=workers, shards=shards, where=where, system=system)
        cpu = {}
        floors = [dict(r, floor_s=cores_floor_s(r)) for r in rs]
        for field in ("cpu_busy", "worker_cpu_ms", "ps_cpu_ms", "floor_s"):
            got = [r[field] for r in floors if r.get(field) is not None]
            cpu[field] = statistics.median(got) if got else None
        out.append(dict(case, label=LABELS[system], **rows.over_repeats(rs), **cpu))
    for row in out:
        alone = _compute_alone(out, row["compute_ms"])
        row["vs_compute"] = row["step_s"] / alone["step_s"] if alone else None
        floor = row["floor_s"]
        row["floor_vs_compute"] = floor / alone["step_s"] if alone and floor is not None else None
        same = _find(out, dict(row, where="processes")) if row["where"] == "containers" else None
        row["vs_processes"] = row["step_s"] / same["step_s"] if same else None
    return out


def _compute_alone(rs: list[dict[str, Any]], compute_ms: int) -> Optional[dict[str, Any]]:
    return next((r for r in rs if r["compute_ms"] == compute_ms and r["system"] == "compute"), None)


def _find(rs: list[dict[str, Any]], like: dict[str, Any]) -> Optional[dict[str, Any]]:
    return next((r for r in rs if key(r) == key(like)), None)


def table(rs: list[dict[str, Any]], update: dict[str, Any] | None = None) -> str:
    """One block per C: each case's s/step, x compute alone, x processes, the host's cores
    busy, the CPU milliseconds a worker step and a PS push took, the shortest step that CPU
    allows on the host's cores (x compute alone: `cores x`), steps, range; and, given the PS's
    `update` of one async push alone (bench.ps_update), the floor it puts under async's step."""
    blocks = []
    for c in dict.fromkeys(r["compute_ms"] for r in rs):
        head = (
            f"  {'case':<52} {'s/step':>7} {'x compute':>9} {'x procs':>7} {'cpu':>4} {'wkr ms':>6} {'ps ms':>6}"
            f" {'cores x':>7} {'steps':>5}  range"
        )
        lines = []
        for r in (r for r in rs if r["compute_ms"] == c):
            ratio, procs = rows.ratio_text(r["vs_compute"]), rows.ratio_text(r["vs_processes"])
            floor = rows.ratio_text(r.get("floor_vs_compute"))
            cpu = "-" if r.get("cpu_busy") is None else f"{100 * r['cpu_busy']:.0f}%"
            worker, ps = (_ms(r.get(f"{role}_cpu_ms")) for role in ("worker", "ps"))
            lines.append(
                f"  {_name(r):<52} {r['step_s']:>7.3f} {ratio:>9} {procs:>7} {cpu:>4} {worker:>6} {ps:>6}"
                f" {floor:>7} {r['steps']:>5}  {rows.range_text(r)}"
            )
        title = f"C = {c} ms (ResNet-18's 11.2 M parameters, batch 20, compute a sleep of C over its layers)"
        alone = _compute_alone(rs, c)
        if update is not None and alone is not None and any(r["system"] == "async" for r in rs if r["compute_ms"] == c):
            lines.append(async_floor_line(alone["step_s"], update))
        blocks.append("\n".join(rows.block(title, head, lines)))
    return "\n\n".join(blocks)


def async_floor(compute_s: float, update_s: float) -> float:
    """The shortest plain async step whose answer waits for the whole update, x compute alone: a
    worker's next forward then waits for its push to be applied, so a step is at least compute
    alone plus the PS's update of that push. (A CPU worker's answer is streamed: it goes once the
    first partition is written, and the step may go under this floor.)"""
    return (compute_s + update_s) / compute_s


def async_floor_line(compute_s: float, update: dict[str, Any]) -> str:
    """The line under a block that says that floor, from the update's figures (bench.ps_update)."""
    floor = async_floor(compute_s, update["update_s"])
    return (
        f"  floor of async answered whole: compute alone + the PS's update of one push alone, "
        f"{1000 * update['update_s']:.1f} ms ({update['threads']} threads; its worker proved it finite: a push "
        f"without that proof adds a NaN/inf check of {1000 * update['check_s']:.1f} ms): {floor:.2f}x\n"
        "  (these workers are CPU processes: their answers are streamed, sent once the first partition of the "
        "new state is written, the rest written as the forward reads it: a step may go under that floor)"
    )


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _name(r: dict[str, Any]) -> str:
    if r["system"] == "compute":
        return r["label"]
    shards = f", {r['shards']} shards" if r["shards"] > 1 else ""
    workers = f"{r['workers']} worker" + ("s" if r["workers"] > 1 else "")
    return f"{r['label']}, {workers}{shards}, {r['where']}"


# The `--json` document: document(rows, runs, settings, machine, failures, wall_s).
document = functools.partial(rows.document, "gpu", SCHEMA)
