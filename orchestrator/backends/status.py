"""What `status` prints, pure: service states and metrics lines in, lines out.

Two tables: the metrics columns (state, exit code, last step, loss, accuracy: compose) and
the tasks' (newest task's state, exit code, retries, error: swarm); under the metrics table,
the live line: the workers the PS counts as joined whose service runs now, and the progress
line: how far the run was at the PS's last evaluation (step of total, percent, samples/s, ETA).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Optional

from app.contract import Event
from orchestrator.backends.base import ServiceState
from orchestrator.metrics.records import headline, is_event, parse_lines
from orchestrator.topology.services import worker_name


def summarize_metrics(lines: Iterable[str]) -> dict[str, Any]:
    """Last step, loss and headline metric (`metric`: its name, accuracy unless the run's
    evaluation gives another; `value`) in a metrics file; bad or partial lines are skipped."""
    out: dict[str, Any] = {"step": None, "loss": None, "metric": "accuracy", "value": None, "event": None}
    for rec in parse_lines(lines):
        for key in ("step", "loss", "event"):
            if rec.get(key) is not None:
                out[key] = rec[key]
        name = headline(rec)
        if rec.get(name) is not None and is_event(rec, Event.EVAL, Event.END):
            out["metric"], out["value"] = name, rec[name]
    return out


def live_workers(lines: Iterable[str], running: Optional[set[int]] = None) -> Optional[dict[str, Any]]:
    """The PS's live set from its records (`ps.jsonl`): the ranks joined and not since left or
    dropped, and of those running now (`running`: the worker ranks whose service runs; None:
    every one), named as the table names them (worker<rank>); with the version of the last
    change (`ended`: the run's end, after which none is live). None before any join."""
    live: set[int] = set()
    last: Optional[dict[str, Any]] = None
    for rec in parse_lines(lines):
        rank = rec.get("worker_rank")
        if is_event(rec, Event.START):  # a restarted PS: every worker joins it again
            live, last = set(), None
        if is_event(rec, Event.END) and last is not None:  # every worker finished: none trains any more
            live = set()
        elif is_event(rec, Event.JOIN, Event.BACK) and isinstance(rank, int):
            live.add(rank)
        elif is_event(rec, Event.LEFT, Event.DROP) and isinstance(rank, int):
            live.discard(rank)
        else:
            continue
        last = rec
    if last is None:
        return None
    now = sorted(r for r in live if running is None or r in running)
    ended = is_event(last, Event.END)
    return {"workers": [worker_name(r) for r in now], "version": last.get("step"), "ended": ended}


def format_live(live: Optional[dict[str, Any]]) -> str:
    """`live workers: 3 (worker1 worker2 worker4), last change at version 812`."""
    if live is None:
        return "live workers: - (no worker joined yet)"
    if live.get("ended"):
        return f"live workers: 0 (the run ended at version {live['version']})"
    names = " ".join(live["workers"]) or "none"
    return f"live workers: {len(live['workers'])} ({names}), last change at version {live['version']}"


def latest_progress(lines: Iterable[str]) -> Optional[dict[str, Any]]:
    """The PS's newest `eval` or `end` record of its newest run (since its last `start`); None
    before its first evaluation."""
    last: Optional[dict[str, Any]] = None
    for rec in parse_lines(lines):
        if is_event(rec, Event.START):
            last = None
        elif is_event(rec, Event.EVAL, Event.END):
            last = rec
    return last


def clock(seconds: float) -> str:
    """`H:MM:SS`, rounded to the second (app.training.progress.clock's format)."""
    whole = int(round(seconds))
    return f"{whole // 3600}:{whole % 3600 // 60:02d}:{whole % 60:02d}"


def format_progress(rec: Optional[dict[str, Any]], now: float) -> str:
    """`progress: step 1200 of 4680 (25.6%), 812 samples/s, ETA 0:04:17 (at the PS's last
    evaluation, 9 s ago)`: the PS's eval line's words (app.training.progress), from its record;
    the ETA is as of that evaluation, at the pace since the one before it."""
    if rec is None:
        return "progress: - (no evaluation yet)"
    step = rec.get("step")
    if is_event(rec, Event.END):
        return f"progress: ended at step {step}"
    total, pace = rec.get("total"), f"{rec.get('samples_per_s', 0):.0f} samples/s"
    if total is None:
        where = f"step {step} (total unknown), {pace}"
    else:
        eta = rec.get("eta_s")
        where = (
            f"step {step} of {total} ({rec.get('percent')}%), {pace}, ETA {'unknown' if eta is None else clock(eta)}"
        )
    return f"progress: {where} (at the PS's last evaluation, {max(0, round(now - rec['time']))} s ago)"


def service_row(state: ServiceState, metric_lines: list[str]) -> dict[str, Any]:
    row: dict[str, Any] = {
        "service": state.service,
        "status": state.status,
        "exit_code": state.exit_code,
        "health": state.health,
        "restarts": state.restarts,
    }
    row.update({k: v for k, v in summarize_metrics(metric_lines).items() if k != "event"})
    return row


def format_status(rows: list[dict[str, Any]]) -> list[str]:
    """One line per service: state, exit code, last step, loss, the headline metric (ACCURACY,
    or the run's own: PERPLEXITY...)."""

    def num(v: Any, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    metric = next((r["metric"] for r in rows if r.get("value") is not None), "accuracy")
    lines = [f"{'SERVICE':<10} {'STATE':<22} {'EXIT':>4} {'STEP':>7} {'LOSS':>8} {metric.upper():>8}"]
    for r in rows:
        state = r["status"] + (f" ({r['health']})" if r.get("health") and r["status"] == "running" else "")
        if r.get("restarts"):
            state += f" x{r['restarts']}"
        exit_code = "-" if r["status"] in ("running", "no container", "created") else num(r["exit_code"], "d")
        lines.append(
            f"{r['service']:<10} {state:<22} {exit_code:>4} {num(r['step'], 'd'):>7} "
            f"{num(r['loss'], '.4f'):>8} {num(r.get('value'), '.4f'):>{max(8, len(metric))}}"
        )
    return lines


def status_document(
    target: str,
    name: str,
    file: str,
    rows: list[dict[str, Any]],
    live: Optional[dict[str, Any]] = None,
    progress: Optional[dict[str, Any]] = None,
) -> dict[str, Any]:
    """What `status --json` prints: one document, the same keys whatever the run's state
    (null where not known): the cluster, one object per service (the table's columns), the PS's
    live workers and its last evaluation record."""
    return {"target": target, "name": name, "file": file, "services": rows, "live": live, "progress": progress}


def state_row(s: ServiceState) -> dict[str, Any]:
    """A task-table line (swarm) as `status --json` gives it."""
    return {
        "service": s.service,
        "status": s.status,
        "task": s.task,
        "exit_code": s.exit_code,
        "restarts": s.restarts,
        "error": s.error,
    }


def format_states(states: list[ServiceState]) -> list[str]:
    """One line per service: newest task's state, exit code, retries, error."""
    lines = [f"{'SERVICE':<10} {'TASK':<10} {'EXIT':>4} {'RETRIES':>7}  ERROR"]
    for s in states:
        code = "-" if s.exit_code is None else str(s.exit_code)
        lines.append(f"{s.service:<10} {s.task or s.status:<10} {code:>4} {s.restarts:>7}  {s.error}".rstrip())
    return lines
