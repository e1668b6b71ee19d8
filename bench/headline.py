"""The headline table of `python -m bench`: seconds per step of each strategy against the
compute-only step of the same run; its JSON document and the comparison of two of them.

Pure: no I/O, no timing. A case's raw result is bench.procs.run_case's; its steady-state
step is the timed window over the step count (warm-up steps are not in the window).
"""

from __future__ import annotations

import functools
import statistics
from typing import Any, Optional

from bench import rows

SCHEMA = 1  # bump when a field of the JSON document changes meaning
SYSTEMS = ("compute", "app", "app-overlap", "app-sync", "allreduce", "official", "ref", "ref-uv")
# The default rows: the published example itself is the reference (`ref`, `ref-uv`: the
# re-implementation, bench/reference.py, on request).
DEFAULT_SYSTEMS = ("compute", "app", "app-overlap", "app-sync", "allreduce", "official")
LABELS = {
    "compute": "compute only (no PS)",
    "app": "ps-compose async",
    "app-overlap": "ps-compose async --overlap",
    "app-sync": "ps-compose sync",
    "allreduce": "allreduce (DDP, Gloo)",
    "official": "official PS example (published file)",
    "ref": "re-implemented PS example, TP defaults",
    "ref-uv": "re-implemented PS example, uv only",
}
MODEL_LABELS = {
    "resnet18-10": "ResNet-18, 10 classes, batch 20 of 3x32x32",
    "mnist-cnn": "MNIST-example CNN, batch 32 of 1x28x28",
}
# The figure `compare` sets side by side, per kind of document, and whether lower is better.
COMPARED = {"headline": ("step_s", True), "full": ("updates_per_s", False)}


def case_row(system: str, model: str, workers: int, raw: dict[str, Any]) -> dict[str, Any]:
    """One case -> its steady-state figures: `step_s` is the mean over workers of each
    worker's window / steps; `compute_s` and `comm_s` are medians of the step's parts."""
    ws = raw["workers"]
    per_worker = [w["window_s"] / w["steps"] for w in ws]
    return {
        "system": system,
        "model": model,
        "workers": workers,
        "steps": min(w["steps"] for w in ws),
        "step_s": statistics.mean(per_worker),
        "per_worker_step_s": per_worker,
        "compute_s": _mean_or_none(w.get("compute_s") for w in ws),
        "comm_s": _mean_or_none(w.get("comm_s") for w in ws),
    }


def _mean_or_none(values: Any) -> Optional[float]:
    """The mean, or None when a worker did not time the part (the published example times
    whole steps only)."""
    got = list(values)
    return None if not got or any(v is None for v in got) else statistics.mean(got)


def aggregate(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Median step over the repeats of each (model, workers, system), with its range;
    `vs_compute` is that step / the compute-only step of the same model and workers.
    Rows keep the models' first-seen order, then SYSTEMS order."""
    models = list(dict.fromkeys(r["model"] for r in runs))
    groups = rows.grouped(
        runs,
        lambda r: (r["model"], r["workers"], r["system"]),
        lambda k: (models.index(k[0]), k[1], SYSTEMS.index(k[2])),
    )
    out = []
    for (model, workers, system), rs in groups:
        out.append(
            {
                "model": model,
                "workers": workers,
                "system": system,
                "label": LABELS[system],
                **rows.over_repeats(rs),
                "compute_s": _median_or_none(r["compute_s"] for r in rs),
                "comm_s": _median_or_none(r["comm_s"] for r in rs),
            }
        )
    for row in out:
        only = _find(out, row["model"], row["workers"], "compute")
        row["vs_compute"] = row["step_s"] / only["step_s"] if only else None
    return out


def _median_or_none(values: Any) -> Optional[float]:
    got = list(values)
    return None if any(v is None for v in got) else statistics.median(got)


def _find(rs: list[dict[str, Any]], model: str, workers: int, system: str) -> Optional[dict[str, Any]]:
    return next((r for r in rs if (r["model"], r["workers"], r["system"]) == (model, workers, system)), None)


def table(rs: list[dict[str, Any]]) -> str:
    """One block per model: strategy, s/step, x compute only, and the spread over repeats."""
    blocks = []
    for model, workers in dict.fromkeys((r["model"], r["workers"]) for r in rs):
        head = f"  {'strategy':<34} {'s/step':>7} {'x compute':>9} {'steps':>5}"
        lines = []
        for r in (r for r in rs if (r["model"], r["workers"]) == (model, workers)):
            spread = f"  ({rows.range_text(r)})" if r["repeats"] > 1 else ""
            ratio = rows.ratio_text(r["vs_compute"])
            lines.append(f"  {r['label']:<34} {r['step_s']:>7.3f} {ratio:>9} {r['steps']:>5}{spread}")
        blocks.append("\n".join(rows.block(f"{MODEL_LABELS.get(model, model)}, {workers} workers", head, lines)))
    return "\n\n".join(blocks)


# The `--json` document: document(rows, runs, settings, machine, failures, wall_s).
document = functools.partial(rows.document, "headline", SCHEMA)


def compare(old: dict[str, Any], new: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows both documents have, with the compared figure of each and new / old.

    ValueError when they are not documents of the same kind (a headline run against a
    full matrix) or of a schema this code does not read."""
    kinds = {doc.get("kind", "full") for doc in (old, new)}  # documents before SCHEMA: full
    if len(kinds) != 1:
        raise ValueError(f"cannot compare a {' and a '.join(sorted(kinds))} document")
    for doc in (old, new):
        if doc.get("schema", SCHEMA) > SCHEMA:
            raise ValueError(f"schema {doc['schema']}: this bench reads schema <= {SCHEMA}")
    figure, lower_better = COMPARED[kinds.pop()]
    before = {(r["model"], r["workers"], r["system"]): r for r in old["rows"]}
    out = []
    for r in new["rows"]:
        o = before.get((r["model"], r["workers"], r["system"]))
        if o is None or not o.get(figure) or r.get(figure) is None:
            continue
        out.append(
            {
                "model": r["model"],
                "workers": r["workers"],
                "system": r["system"],
                "figure": figure,
                "old": o[figure],
                "new": r[figure],
                "ratio": r[figure] / o[figure],
                "lower_is_better": lower_better,
            }
        )
    return out


def compare_table(pairs: list[dict[str, Any]]) -> str:
    """`compare`'s rows as text; `better`/`worse` past a 5% change."""
    if not pairs:
        return "no rows in common"
    figure = pairs[0]["figure"]
    head = f"{'model':<12} {'wk':>2} {'system':<14} {figure + ' old':>18} {'new':>10} {'new/old':>8}"
    lines = [head, "-" * len(head)]
    for p in pairs:
        gain = (p["ratio"] < 0.95) if p["lower_is_better"] else (p["ratio"] > 1.05)
        loss = (p["ratio"] > 1.05) if p["lower_is_better"] else (p["ratio"] < 0.95)
        verdict = "better" if gain else "worse" if loss else ""
        lines.append(
            f"{p['model']:<12} {p['workers']:>2} {p['system']:<14} {p['old']:>18.4g} "
            f"{p['new']:>10.4g} {p['ratio']:>7.2f}x {verdict}"
        )
    return "\n".join(lines)
