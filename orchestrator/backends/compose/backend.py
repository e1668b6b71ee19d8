"""The compose target: one host, `docker compose` (render: orchestrator/render/compose.py;
verbs: backends/compose/verbs.py)."""

from __future__ import annotations

from typing import Any, Optional

from orchestrator.backends.base import Backend
from orchestrator.backends.compose import doctor
from orchestrator.doctor.checks import CheckFn
from orchestrator.doctor.facts import Facts
from orchestrator.render import compose
from orchestrator.topology.model import Topology


class ComposeBackend(Backend):
    name = "compose"
    output = "compose.yaml"
    noun = "project"
    summary = "compose (docker compose, one host)"
    verb_prefix = ""
    smoke_timeout = 900
    verb_help = {
        "up": "render if needed, build if the image is missing, start detached",
        "down": "stop and remove the cluster (the volume with checkpoints and metrics stays)",
        "logs": "follow every service's log, prefixed by service",
        "status": "one line per service: state, exit code, last step, loss",
        "smoke": "the CPU cluster end to end in containers; checks accuracy and exit codes",
        "scale": "grow or shrink the running cluster to --workers N (up to workers.max) without stopping it",
    }

    def render(self, t: Topology, data_root: str) -> str:
        return compose.dump(compose.render(t), t.name)

    def name_of(self, t: Topology) -> str:
        return compose.project_name(t)

    def checks(self) -> list[CheckFn]:
        return list(doctor.CHECKS)

    def gather_facts(self, t: Topology, client: Any, facts: Facts, probe: bool) -> dict[str, Any]:
        return doctor.gather_facts(t, client, facts, probe)

    def up(self, config: str, workers: Optional[int], *, strategy: Optional[str], offline: bool, resume: bool) -> int:
        from orchestrator.backends.compose import verbs

        return verbs.up(config, workers, offline=offline, strategy=strategy, resume=resume)

    def down(self, config: Optional[str], workers: Optional[int], *, strategy: Optional[str], volumes: bool) -> int:
        from orchestrator.backends.compose import verbs

        return verbs.down(config, workers, volumes=volumes, strategy=strategy)

    def logs(self, config: Optional[str], workers: Optional[int], *, strategy: Optional[str], follow: bool) -> int:
        from orchestrator.backends.compose import verbs

        return verbs.logs(config, workers, follow=follow, strategy=strategy)

    def status(self, config: Optional[str], workers: Optional[int], *, strategy: Optional[str]) -> int:
        from orchestrator.backends.compose import verbs

        return verbs.status(config, workers, strategy=strategy)

    def smoke(self, config: str, workers: int, *, strategy: Optional[str], timeout: int) -> int:
        from orchestrator.backends.compose import verbs

        return verbs.smoke(config, workers, timeout=timeout, strategy=strategy)

    def scale(self, config: Optional[str], workers: int) -> int:
        from orchestrator.backends.compose import verbs

        return verbs.scale(config, workers)


BACKEND = ComposeBackend()
