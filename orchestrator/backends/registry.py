"""The targets, by name: the CLI's `--target` choices and its lifecycle verbs come from here;
`LOCAL`, the job as local processes, gives the same blocks (its verb is `local`, its runs are
listed apart), and `RUNNING` names every target a run can be started on through them."""

from __future__ import annotations

from orchestrator.backends.base import Backend
from orchestrator.backends.compose.backend import BACKEND as COMPOSE
from orchestrator.backends.kubernetes.backend import BACKEND as KUBERNETES
from orchestrator.backends.local.backend import BACKEND as LOCAL
from orchestrator.backends.swarm.backend import BACKEND as SWARM
from orchestrator.errors import UsageError

BACKENDS: dict[str, Backend] = {b.name: b for b in (COMPOSE, SWARM, KUBERNETES)}
DEFAULT = COMPOSE.name
RUNNING: dict[str, Backend] = {b.name: b for b in (LOCAL, COMPOSE, SWARM)}


def get(name: str) -> Backend:
    try:
        return BACKENDS[name]
    except KeyError:
        raise UsageError(f"--target: got {name!r}; one of {', '.join(BACKENDS)}") from None
