"""From raw case results to rows, the goal ratios, a table and JSON. Pure: no I/O, no timing."""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any, Optional

SYSTEMS = (
    "app",
    "app-comm",
    "app-overlap",
    "app-bf16",
    "app-comm-bf16",
    "app-sharded",
    "ref",
    "ref-tuned",
    "gloo",
    "memcpy",
)
LABELS = {
    "app": "app PS",
    "app-comm": "app PS, no compute",
    "app-overlap": "app PS --overlap",
    "app-bf16": "app PS --compress bf16",
    "app-comm-bf16": "app bf16, no compute",
    "app-sharded": "app 2 shards, no comp",
    "ref": "reference PS",
    "ref-tuned": "reference, app opts",
    "gloo": "Gloo send+recv",
    "memcpy": "memcpy",
}
TRAINING = ("app", "app-overlap", "app-bf16", "ref", "ref-tuned")  # the systems that train a model
GOALS = {  # ratio name -> (comparison, bound, what it says)
    "app_vs_ref_updates": (">=", 3.0, "app updates/s / reference updates/s"),
    "pushpull_vs_gloo": ("<=", 1.0, "app push+pull s / Gloo send+recv s (resnet18, no compute)"),
    "pushpull_vs_memcpy": ("<=", 4.0, "app push+pull s / memcpy s (resnet18, no compute)"),
    "comm_overhead": ("<=", 0.15, "(app --overlap step s - compute-only step s) / compute-only step s"),
    "idle_cpu_percent": ("<", 5.0, "% of a core, idle app PS and worker"),
}
INFO = {  # figures that explain the goals' ones; no bound
    "app_vs_ref_tuned_updates": "app updates/s / reference-with-the-app's-options updates/s",
    "comm_overhead_no_overlap": "the same without --overlap: (app step s - compute-only s) / compute-only s",
    "overlap_vs_app_updates": "app --overlap updates/s / app updates/s",
    "bf16_vs_app_updates": "app --compress bf16 updates/s / app updates/s",
    "pushpull_bf16_vs_gloo": "push+pull s with a bf16 push / Gloo send+recv s of the float32 bytes",
    "sharded_vs_app_updates": "app with 2 PS shards updates/s / app updates/s (resnet18, no compute)",
}


def case_row(system: str, model: str, workers: int, batch: int, raw: dict[str, Any]) -> dict[str, Any]:
    """One run of one case -> its figures; `raw` is procs.run_case's result."""
    ws = raw["workers"]
    updates = sum(w["steps"] / w["window_s"] for w in ws)
    per_update = ws[0]["push_bytes"] + ws[0]["pull_bytes"]
    only = [w["compute_only_s"] for w in ws if w.get("compute_only_s") is not None]
    return {
        "system": system,
        "model": model,
        "workers": workers,
        "updates_per_s": updates,
        "samples_per_s": updates * batch if system in TRAINING else None,
        "push_pull_s": statistics.mean(w["comm_s"] for w in ws),
        "compute_s": statistics.mean(w["compute_s"] for w in ws),
        "compute_only_s": statistics.mean(only) if only else None,
        "step_s": statistics.mean(w["step_s"] for w in ws),
        "bytes_per_update": per_update,
        "gb_per_s": per_update * updates / 1e9,
        "idle_cpu_percent": raw.get("idle_cpu_percent"),
    }


def memcpy_row(model: str, workers: int, floats: int, seconds: float) -> dict[str, Any]:
    """A copy of the message in and of the state out, `seconds` for both."""
    per_update = 2 * 4 * floats
    return {
        "system": "memcpy",
        "model": model,
        "workers": workers,
        "updates_per_s": 1 / seconds,
        "samples_per_s": None,
        "push_pull_s": seconds,
        "compute_s": 0.0,
        "compute_only_s": None,
        "step_s": seconds,
        "bytes_per_update": per_update,
        "gb_per_s": per_update / seconds / 1e9,
        "idle_cpu_percent": None,
    }


def _median(values: list[Any]) -> Any:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def aggregate(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Median of every figure over the repeats of each (model, workers, system), with the
    updates/s range and the repeat count; rows in model, workers, system order."""
    groups: dict[tuple[str, int, str], list[dict[str, Any]]] = defaultdict(list)
    order: list[tuple[str, int, str]] = []
    for r in runs:
        key = (r["model"], r["workers"], r["system"])
        if key not in groups:
            order.append(key)
        groups[key].append(r)
    rows = []
    for key in sorted(
        order, key=lambda k: (order.index(next(o for o in order if o[0] == k[0])), k[1], SYSTEMS.index(k[2]))
    ):
        rs = groups[key]
        row: dict[str, Any] = {"model": key[0], "workers": key[1], "system": key[2], "repeats": len(rs)}
        for field in rs[0]:
            if field in row:
                continue
            if field == "idle_cpu_percent":
                idle = [r[field] for r in rs if r[field]]
                row[field] = {k: _median([i[k] for i in idle]) for k in idle[0]} if idle else None
            else:
                row[field] = _median([r[field] for r in rs])
        ups = [r["updates_per_s"] for r in rs]
        row["updates_per_s_range"] = [min(ups), max(ups)]
        rows.append(row)
    return rows


def _find(rows: list[dict[str, Any]], model: str, workers: int, system: str) -> Optional[dict[str, Any]]:
    return next((r for r in rows if (r["model"], r["workers"], r["system"]) == (model, workers, system)), None)


def ratios(rows: list[dict[str, Any]], big: str = "resnet18") -> dict[str, dict[str, Any]]:
    """Each goal's figure per setting, e.g. ratios()["app_vs_ref_updates"]["cnn/2"]."""
    out: dict[str, dict[str, Any]] = {name: {} for name in (*GOALS, *INFO)}
    for model, workers in sorted({(r["model"], r["workers"]) for r in rows}):
        where = f"{model}/{workers}"
        app, ref = _find(rows, model, workers, "app"), _find(rows, model, workers, "ref")
        if app and ref:
            out["app_vs_ref_updates"][where] = app["updates_per_s"] / ref["updates_per_s"]
        if app and app["compute_only_s"] and model != big:
            out["comm_overhead_no_overlap"][where] = (app["step_s"] - app["compute_only_s"]) / app["compute_only_s"]
        tuned, over = _find(rows, model, workers, "ref-tuned"), _find(rows, model, workers, "app-overlap")
        if app and tuned:
            out["app_vs_ref_tuned_updates"][where] = app["updates_per_s"] / tuned["updates_per_s"]
        if over and app:
            out["overlap_vs_app_updates"][where] = over["updates_per_s"] / app["updates_per_s"]
        if over and app and app["compute_only_s"] and model != big:
            out["comm_overhead"][where] = (1 / (over["updates_per_s"] / workers) - app["compute_only_s"]) / app[
                "compute_only_s"
            ]
        bf16 = _find(rows, model, workers, "app-bf16")
        if bf16 and app:
            out["bf16_vs_app_updates"][where] = bf16["updates_per_s"] / app["updates_per_s"]
        comm = _find(rows, model, workers, "app-comm")
        gloo, mem = _find(rows, model, workers, "gloo"), _find(rows, model, workers, "memcpy")
        if comm and gloo:
            out["pushpull_vs_gloo"][where] = comm["push_pull_s"] / gloo["push_pull_s"]
        if comm and mem:
            out["pushpull_vs_memcpy"][where] = comm["push_pull_s"] / mem["push_pull_s"]
        sharded = _find(rows, model, workers, "app-sharded")
        if sharded and comm:
            out["sharded_vs_app_updates"][where] = sharded["updates_per_s"] / comm["updates_per_s"]
        comm16 = _find(rows, model, workers, "app-comm-bf16")
        if comm16 and gloo:
            out["pushpull_bf16_vs_gloo"][where] = comm16["push_pull_s"] / gloo["push_pull_s"]
        for system in ("app", "ref"):
            row = _find(rows, model, workers, system)
            if row and row.get("idle_cpu_percent"):
                for role, pct in row["idle_cpu_percent"].items():
                    key = f"{role}" if system == "app" else f"{role} (reference, for contrast)"
                    out["idle_cpu_percent"][key] = pct
    return out


def verdicts(rs: dict[str, dict[str, Any]]) -> dict[str, Optional[bool]]:
    """Whether each goal holds in every setting measured (None: not measured)."""
    result: dict[str, Optional[bool]] = {}
    for name, (op, bound, _) in GOALS.items():
        values = [v for k, v in rs[name].items() if "reference" not in k]
        if not values:
            result[name] = None
        else:
            result[name] = all(v >= bound if op == ">=" else v <= bound if op == "<=" else v < bound for v in values)
    return result


def _num(v: Any, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'model':<10} {'wk':>2} {'system':<22} {'updates/s':>10} {'samples/s':>9} "
        f"{'push+pull ms':>12} {'compute ms':>10} {'GB/s':>6} {'MB/update':>9}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lo, hi = r["updates_per_s_range"]
        spread = f" ({lo:.0f}-{hi:.0f})" if r["repeats"] > 1 and r["system"] != "memcpy" else ""
        lines.append(
            f"{r['model']:<10} {r['workers']:>2} {LABELS[r['system']]:<22} "
            f"{r['updates_per_s']:>10.1f} {_num(r['samples_per_s'], '9.0f'):>9} "
            f"{r['push_pull_s'] * 1e3:>12.2f} {_num(r['compute_s'] and r['compute_s'] * 1e3, '10.1f'):>10} "
            f"{r['gb_per_s']:>6.2f} {r['bytes_per_update'] / 1e6:>9.2f}{spread}"
        )
    return "\n".join(lines)


def ratio_lines(rs: dict[str, dict[str, Any]]) -> str:
    ok = verdicts(rs)
    lines = []
    for name, (op, bound, what) in GOALS.items():
        status = {True: "met", False: "NOT met", None: "not measured"}[ok[name]]
        values = ", ".join(f"{k} {v:.2f}" for k, v in rs[name].items())
        lines.append(f"{name} (goal {op} {bound:g}: {what}): {status}\n    {values or '-'}")
    for name, what in INFO.items():
        values = ", ".join(f"{k} {v:.2f}" for k, v in rs.get(name, {}).items())
        if values:
            lines.append(f"{name} ({what}):\n    {values}")
    return "\n".join(lines)
