"""The state of a compose project read back, pure: containers (`docker inspect` attrs) in,
one `ServiceState` per service out (what `describe` gives the verbs)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from orchestrator.backends.base import ServiceState
from orchestrator.backends.inspect import from_container
from orchestrator.render.compose import SERVING

# Labels compose (v1 and v2) puts on every container it creates.
LABEL_PROJECT = "com.docker.compose.project"
LABEL_SERVICE = "com.docker.compose.service"


def container_state(attrs: dict[str, Any]) -> ServiceState:
    """The bits of `docker inspect` that the verbs use; `spec` from its labels and environment."""
    state = attrs.get("State") or {}
    labels = (attrs.get("Config") or {}).get("Labels") or {}
    return ServiceState(
        service=labels.get(LABEL_SERVICE, (attrs.get("Name") or "?").lstrip("/")),
        status=state.get("Status", "unknown"),
        exit_code=state.get("ExitCode"),
        health=(state.get("Health") or {}).get("Status"),
        restarts=attrs.get("RestartCount", 0) or 0,
        spec=from_container(attrs, LABEL_SERVICE),
    )


def service_states(containers: Sequence[dict[str, Any]]) -> list[ServiceState]:
    """One state per service of the project's containers (`docker inspect` attrs), `make
    tensorboard`'s and the MLflow server's left out (no part of the run: they serve it, and the
    MLflow server outlives it). Of several containers of one service,
    a one-off (`compose run`) counts only when there is no other; among equals, the newest
    (`Created`) counts."""
    chosen: dict[str, ServiceState] = {}
    ranked = sorted(containers, key=lambda a: (not _one_off(a), a.get("Created") or ""))
    for attrs in ranked:  # the best last: it overwrites
        s = container_state(attrs)
        if s.service not in SERVING:
            chosen[s.service] = s
    return list(chosen.values())


def _one_off(attrs: dict[str, Any]) -> bool:
    labels = (attrs.get("Config") or {}).get("Labels") or {}
    return str(labels.get("com.docker.compose.oneoff", "False")).lower() == "true"
