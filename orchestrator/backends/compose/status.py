"""The state of a compose project read back, pure: containers (`docker inspect` attrs)
and metrics lines in, rows out. `status` prints them; the smoke run judges them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Optional

from orchestrator.backends.compose.inspect import from_container
from orchestrator.metrics.records import parse_lines
from orchestrator.topology.services import Service, sort_key

# Labels compose (v1 and v2) puts on every container it creates.
LABEL_PROJECT = "com.docker.compose.project"
LABEL_SERVICE = "com.docker.compose.service"


def container_state(attrs: dict[str, Any]) -> dict[str, Any]:
    """The bits of `docker inspect` that status and smoke use."""
    state = attrs.get("State") or {}
    labels = (attrs.get("Config") or {}).get("Labels") or {}
    return {
        "service": labels.get(LABEL_SERVICE, (attrs.get("Name") or "?").lstrip("/")),
        "status": state.get("Status", "unknown"),
        "exit_code": state.get("ExitCode"),
        "health": (state.get("Health") or {}).get("Status"),
        "restarts": attrs.get("RestartCount", 0) or 0,
    }


def summarize_metrics(lines: Iterable[str]) -> dict[str, Any]:
    """Last step, loss and accuracy in a metrics file; bad or partial lines are skipped."""
    out: dict[str, Any] = {"step": None, "loss": None, "accuracy": None, "event": None}
    for rec in parse_lines(lines):
        for key in ("step", "loss", "accuracy", "event"):
            if rec.get(key) is not None:
                out[key] = rec[key]
    return out


def live_workers(lines: Iterable[str]) -> Optional[dict[str, Any]]:
    """The PS's live set from its records (`ps.jsonl`): the workers joined and not since left or
    dropped, the number the PS counted at its last change, and that change's version; None
    before any join."""
    live: dict[int, str] = {}
    last: Optional[dict[str, Any]] = None
    for rec in parse_lines(lines):
        event, rank = rec.get("event"), rec.get("worker_rank")
        if event == "start":  # a restarted PS: every worker joins it again
            live = {}
        if event in ("join", "back") and isinstance(rank, int):
            live[rank] = str(rec.get("worker", rank))
        elif event in ("left", "drop") and isinstance(rank, int):
            live.pop(rank, None)
        else:
            continue
        last = rec
    if last is None:
        return None
    return {"workers": [live[r] for r in sorted(live)], "count": last.get("workers"), "version": last.get("step")}


def format_live(live: Optional[dict[str, Any]]) -> str:
    """`live workers: 3 (worker1 worker2 worker4), last change at version 812`."""
    if live is None:
        return "live workers: - (no worker joined yet)"
    names = " ".join(live["workers"]) or "none"
    return f"live workers: {len(live['workers'])} ({names}), last change at version {live['version']}"


def status_services(
    configured: Sequence[Service],
    containers: Sequence[dict[str, Any]],
) -> list[tuple[Service, Optional[dict[str, Any]]]]:
    """What `status` lists: every container of the project (`docker inspect` attrs),
    described by its own labels and environment, and every configured service that
    has no container (attrs None); one entry per service name, in rank order.

    Of several containers of one service, a one-off (`compose run`) counts only when
    there is no other; among equals, the newest (`Created`) counts."""
    chosen: dict[str, tuple[Service, dict[str, Any]]] = {}
    ranked = sorted(containers, key=lambda a: (not _one_off(a), a.get("Created") or ""))
    for attrs in ranked:  # the best last: it overwrites
        s = from_container(attrs, LABEL_SERVICE)
        if s is not None:
            chosen[s.name] = (s, attrs)
    listed: list[tuple[Service, Optional[dict[str, Any]]]] = list(chosen.values())
    listed += [(s, None) for s in configured if s.name not in chosen]
    return sorted(listed, key=lambda pair: sort_key(pair[0]))


def _one_off(attrs: dict[str, Any]) -> bool:
    labels = (attrs.get("Config") or {}).get("Labels") or {}
    return str(labels.get("com.docker.compose.oneoff", "False")).lower() == "true"


def service_row(service: str, attrs: Optional[dict[str, Any]], metric_lines: list[str]) -> dict[str, Any]:
    row = (
        container_state(attrs)
        if attrs is not None
        else {"service": service, "status": "no container", "exit_code": None, "health": None, "restarts": 0}
    )
    row["service"] = service
    row.update({k: v for k, v in summarize_metrics(metric_lines).items() if k != "event"})
    return row


def format_status(rows: list[dict[str, Any]]) -> list[str]:
    """One line per service: state, exit code, last step, loss, accuracy."""

    def num(v: Any, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    lines = [f"{'SERVICE':<10} {'STATE':<22} {'EXIT':>4} {'STEP':>7} {'LOSS':>8} {'ACCURACY':>8}"]
    for r in rows:
        state = r["status"] + (f" ({r['health']})" if r.get("health") and r["status"] == "running" else "")
        if r.get("restarts"):
            state += f" x{r['restarts']}"
        exit_code = "-" if r["status"] in ("running", "no container", "created") else num(r["exit_code"], "d")
        lines.append(
            f"{r['service']:<10} {state:<22} {exit_code:>4} {num(r['step'], 'd'):>7} "
            f"{num(r['loss'], '.4f'):>8} {num(r['accuracy'], '.4f'):>8}"
        )
    return lines
