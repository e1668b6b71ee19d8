"""`python -m bench gpu`'s figures: the steady-state step of a case from the times its
workers finished their batches, the rows over repeats, the table and the JSON document.

Pure: no I/O, no timing. A case's raw result is, per worker, the times (seconds, any
origin shared by the case's workers) at which it finished each of its batches, in order.
"""

from __future__ import annotations

import json
import statistics
from typing import Any, Optional

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


def steady_step(times: list[list[float]], warmup: int) -> dict[str, Any]:
    """Seconds per step while every worker of the case is past its warm-up and none has
    ended: the window opens when the last worker finishes its `warmup`-th batch and closes
    when the first worker finishes its last one; each worker's step is the time between
    its first and last batch inside the window over the batches between them; the
    case's is the mean over workers. ValueError when a worker has too few batches."""
    if not times or any(len(t) <= warmup + 1 for t in times):
        counts = [len(t) for t in times]
        raise ValueError(f"a worker finished too few batches for a warm-up of {warmup}: {counts}")
    start = max(t[warmup - 1] if warmup else t[0] for t in times)
    end = min(t[-1] for t in times)
    per_worker, steps = [], []
    for t in times:
        inside = [x for x in t if start <= x <= end]
        if len(inside) < 2:
            raise ValueError("the workers' steady windows do not overlap (one ended before another warmed up)")
        per_worker.append((inside[-1] - inside[0]) / (len(inside) - 1))
        steps.append(len(inside) - 1)
    return {
        "step_s": statistics.mean(per_worker),
        "per_worker_step_s": per_worker,
        "steps": min(steps),
        "batches": [len(t) for t in times],
        "window_s": end - start,
    }


def key(run: dict[str, Any]) -> tuple[int, int, int, str, str]:
    return (run["compute_ms"], run["workers"], run["shards"], run["where"], run["system"])


def aggregate(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Median step over the repeats of each case, its range, and `vs_compute`: that step /
    the compute-alone step of the same C. `vs_processes` (containers only): / the same
    system as processes. Rows sorted by C, workers, shards, where, then SYSTEMS order."""
    groups: dict[tuple[int, int, int, str, str], list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault(key(r), []).append(r)
    rows = []
    for k in sorted(groups, key=lambda k: (k[0], k[1], k[2], WHERE.index(k[3]), SYSTEMS.index(k[4]))):
        rs = groups[k]
        steps = [r["step_s"] for r in rs]
        rows.append(
            {
                "compute_ms": k[0],
                "workers": k[1],
                "shards": k[2],
                "where": k[3],
                "system": k[4],
                "label": LABELS[k[4]],
                "repeats": len(rs),
                "steps": min(r["steps"] for r in rs),
                "step_s": statistics.median(steps),
                "step_s_range": [min(steps), max(steps)],
            }
        )
    for row in rows:
        alone = _compute_alone(rows, row["compute_ms"])
        row["vs_compute"] = row["step_s"] / alone["step_s"] if alone else None
        same = _find(rows, dict(row, where="processes")) if row["where"] == "containers" else None
        row["vs_processes"] = row["step_s"] / same["step_s"] if same else None
    return rows


def _compute_alone(rows: list[dict[str, Any]], compute_ms: int) -> Optional[dict[str, Any]]:
    return next((r for r in rows if r["compute_ms"] == compute_ms and r["system"] == "compute"), None)


def _find(rows: list[dict[str, Any]], like: dict[str, Any]) -> Optional[dict[str, Any]]:
    return next((r for r in rows if key(r) == key(like)), None)


def table(rows: list[dict[str, Any]]) -> str:
    """One block per C: each case's s/step, x compute alone, x processes, steps, range."""
    lines: list[str] = []
    for c in dict.fromkeys(r["compute_ms"] for r in rows):
        if lines:
            lines.append("")
        lines.append(f"C = {c} ms (ResNet-18's 11.7 M parameters, batch 20, compute a sleep of C)")
        head = f"  {'case':<52} {'s/step':>7} {'x compute':>9} {'x procs':>7} {'steps':>5}  range"
        lines += [head, "  " + "-" * (len(head) - 2)]
        for r in (r for r in rows if r["compute_ms"] == c):
            shards = f", {r['shards']} shards" if r["shards"] > 1 else ""
            where = "" if r["system"] == "compute" else f", {r['where']}"
            name = f"{r['label']}, {r['workers']} workers{shards}{where}"
            if r["system"] == "compute":
                name = r["label"]
            ratio = "-" if r["vs_compute"] is None else f"{r['vs_compute']:.2f}x"
            procs = "-" if r["vs_processes"] is None else f"{r['vs_processes']:.2f}x"
            lo, hi = r["step_s_range"]
            spread = f"{lo:.3f}-{hi:.3f}" if r["repeats"] > 1 else ""
            lines.append(f"  {name:<52} {r['step_s']:>7.3f} {ratio:>9} {procs:>7} {r['steps']:>5}  {spread}")
    return "\n".join(lines)


def document(
    rows: list[dict[str, Any]],
    runs: list[dict[str, Any]],
    settings: dict[str, Any],
    machine: dict[str, Any],
    failures: list[str],
    wall_s: float,
) -> dict[str, Any]:
    """The `--json` document."""
    doc = {
        "schema": SCHEMA,
        "kind": "gpu",
        "machine": machine,
        "settings": settings,
        "wall_s": wall_s,
        "rows": rows,
        "runs": runs,
        "failures": failures,
    }
    json.dumps(doc)  # fails here, not half-written, when something is not JSON
    return doc
