"""The pieces the step tables share (the headline's, bench/headline.py, and the GPU regime's,
bench/gpu_report.py): a case's runs grouped and folded into one row over its repeats, a ratio
and a range as printed, a block of the table, the `--json` document. Pure: no I/O, no timing."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

K = TypeVar("K", bound=Hashable)


def grouped(
    runs: list[dict[str, Any]], key: Callable[[dict[str, Any]], K], order: Callable[[K], Any]
) -> list[tuple[K, list[dict[str, Any]]]]:
    """The runs grouped by `key(run)`, the groups sorted by `order(key)`."""
    groups: dict[K, list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault(key(r), []).append(r)
    return [(k, groups[k]) for k in sorted(groups, key=order)]


def over_repeats(rs: list[dict[str, Any]]) -> dict[str, Any]:
    """The repeats of one case: their count, the fewest timed steps, the median step and its range."""
    steps = [r["step_s"] for r in rs]
    return {
        "repeats": len(rs),
        "steps": min(r["steps"] for r in rs),
        "step_s": statistics.median(steps),
        "step_s_range": [min(steps), max(steps)],
    }


def ratio_text(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def range_text(row: dict[str, Any]) -> str:
    """`lo-hi` of the step over repeats; empty for one repeat."""
    lo, hi = row["step_s_range"]
    return f"{lo:.3f}-{hi:.3f}" if row["repeats"] > 1 else ""


def block(title: str, head: str, lines: list[str]) -> list[str]:
    """A table's block: its title, the column heads (indented two), a rule, its lines."""
    return [title, head, "  " + "-" * (len(head) - 2), *lines]


def document(
    kind: str,
    schema: int,
    rows: list[dict[str, Any]],
    runs: list[dict[str, Any]],
    settings: dict[str, Any],
    machine: dict[str, Any],
    failures: list[str],
    wall_s: float,
) -> dict[str, Any]:
    """The `--json` document of a step table: what `compare` reads back (schema, kind, rows)."""
    return {
        "schema": schema,
        "kind": kind,
        "machine": machine,
        "settings": settings,
        "wall_s": wall_s,
        "rows": rows,
        "runs": runs,
        "failures": failures,
    }
