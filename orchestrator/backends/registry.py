"""The targets, by name: the CLI's `--target` choices and its lifecycle verbs come from here."""

from __future__ import annotations

from orchestrator.backends.base import Backend
from orchestrator.backends.compose.backend import BACKEND as COMPOSE
from orchestrator.backends.kubernetes.backend import BACKEND as KUBERNETES
from orchestrator.backends.swarm.backend import BACKEND as SWARM
from orchestrator.errors import UsageError

BACKENDS: dict[str, Backend] = {b.name: b for b in (COMPOSE, SWARM, KUBERNETES)}
DEFAULT = COMPOSE.name


def get(name: str) -> Backend:
    try:
        return BACKENDS[name]
    except KeyError:
        raise UsageError(f"--target: got {name!r}; one of {', '.join(BACKENDS)}") from None
