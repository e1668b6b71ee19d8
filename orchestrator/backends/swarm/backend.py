"""The swarm target: `docker stack deploy` on one or more hosts (render:
orchestrator/render/swarm.py; verbs: backends/swarm/verbs.py, named stack-*)."""

from __future__ import annotations

from typing import Any, Optional

from orchestrator.backends.base import Backend
from orchestrator.backends.swarm import doctor
from orchestrator.doctor.checks import CheckFn
from orchestrator.doctor.facts import Facts
from orchestrator.errors import UsageError
from orchestrator.render import swarm
from orchestrator.topology.model import Topology


class SwarmBackend(Backend):
    name = "swarm"
    output = "stack.yaml"
    noun = "stack"
    summary = "swarm (docker stack deploy, one or more hosts)"
    verb_prefix = "stack-"
    smoke_timeout = 600
    verb_help = {
        "up": "doctor, render runs/<name>/stack.yaml, build if missing, docker stack deploy",
        "down": "docker stack rm, and wait until its containers and network are gone",
        "logs": "every service's log (docker service logs), following",
        "status": "one line per service: its newest task's state, exit code, retries",
        "smoke": "the CPU topology as a swarm stack: accuracy and every task's exit state",
        "scale": "not on Swarm yet: refused with one line (make scale runs on compose)",
    }

    def scale(self, config: Optional[str], workers: int) -> int:
        raise UsageError(
            "stack-scale: a running stack is not scaled yet (its workers are not rendered beyond workers.count); "
            "stop it (make stack-down) and deploy again with the new count: it resumes from its last checkpoint"
        )

    def render(self, t: Topology, data_root: str) -> str:
        # A relative train.data_dir is taken from `data_root` (absolute in the stack file).
        return swarm.dump(swarm.render(t, data_root=data_root), t.name)

    def name_of(self, t: Topology) -> str:
        return swarm.stack_name(t)

    def checks(self) -> list[CheckFn]:
        return list(doctor.CHECKS)

    def gather_facts(self, t: Topology, client: Any, facts: Facts, probe: bool) -> dict[str, Any]:
        return doctor.gather_facts(t, client, facts, probe)

    # The stack's name does not depend on the strategy: down, logs and status take it and
    # need it not (the Makefile passes the last up's flags to every verb alike).
    def up(self, config: str, workers: Optional[int], *, strategy: Optional[str], offline: bool, resume: bool) -> int:
        from orchestrator.backends.swarm import verbs

        return verbs.stack_up(config, workers, offline=offline, strategy=strategy, resume=resume)

    def down(self, config: Optional[str], workers: Optional[int], *, strategy: Optional[str], volumes: bool) -> int:
        from orchestrator.backends.swarm import verbs

        return verbs.stack_down(config, workers, volumes=volumes)

    def logs(self, config: Optional[str], workers: Optional[int], *, strategy: Optional[str], follow: bool) -> int:
        from orchestrator.backends.swarm import verbs

        return verbs.stack_logs(config, workers, follow=follow)

    def status(self, config: Optional[str], workers: Optional[int], *, strategy: Optional[str]) -> int:
        from orchestrator.backends.swarm import verbs

        return verbs.stack_status(config, workers)

    def smoke(self, config: str, workers: int, *, strategy: Optional[str], timeout: int) -> int:
        from orchestrator.backends.swarm import verbs

        return verbs.stack_smoke(config, workers, timeout=timeout, strategy=strategy)


BACKEND = SwarmBackend()
